"""The Kubernetes manifests (deploy/k8s): both overlays render, every rendered
document is valid against the Kubernetes schemas (kubernetes-validate, strict,
offline), and what a user relies on holds: the Services and their ports, the
workers' count against the mesh, the gRPC probes, one GPU per GPU worker,
every flag the containers pass is one the binaries take, and the rendered
configuration starts a real mesh (on loopback)."""
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import kubernetes_validate
import pytest
import yaml

from conftest import BIN, ROOT, Client, free_port

sys.path.insert(0, os.path.join(ROOT, "tools"))
import kustomize_render  # noqa: E402

K8S = os.path.join(ROOT, "deploy", "k8s")
OVERLAYS = ("cpu", "gpu")
# The oldest Kubernetes the manifests are for (native gRPC probes are GA from
# 1.27) and the newest the validator knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CONFIG = "shardgemm-config"

_rendered = {}


def render(overlay):
    if overlay not in _rendered:
        _rendered[overlay] = kustomize_render.render(os.path.join(K8S, "overlays", overlay))
    return _rendered[overlay]


def find(docs, kind, name):
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{len(hits)} {kind} named {name} in {[(d['kind'], d['metadata']['name']) for d in docs]}"
    return hits[0]


def pod_spec(docs, kind, name):
    return find(docs, kind, name)["spec"]["template"]["spec"]


def workloads(docs):
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(docs):
    for w in workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            yield w, c


def flag_values(container):
    """--name=value args as {name: value}."""
    out = {}
    for a in container.get("args", []):
        m = re.fullmatch(r"--([A-Za-z0-9_]+)(?:=(.*))?", a)
        assert m, f"{container['name']}: arg {a!r} is not --flag or --flag=value"
        out[m.group(1)] = m.group(2)
    return out


def config_data(docs):
    return find(docs, "ConfigMap", CONFIG)["data"]


def mesh_size(mesh):
    sizes = []
    for part in mesh.split(","):
        name, _, size = part.partition("=")
        assert name.strip() and size.strip().isdigit(), f"MESH {mesh!r}: {part!r} is not AXIS=SIZE"
        sizes.append(int(size))
    return math.prod(sizes)


def port_of(address):
    return int(address.rpartition(":")[2])


def env_values(container, data, pod_name="shardgemm-worker-0"):
    """The container's environment as Kubernetes would set it from the ConfigMap."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e["valueFrom"]:
            env[e["name"]] = data[e["valueFrom"]["configMapKeyRef"]["key"]]
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = pod_name
    return env


def expand(arg, env):
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_as_kubectl_kustomize_does(overlay):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: rendered with tools/kustomize_render.py alone")
    out = subprocess.run([kubectl, "kustomize", os.path.join(K8S, "overlays", overlay)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
    assert render(overlay) == theirs, "tools/kustomize_render.py and kubectl kustomize differ"


RENDERER_CASE = {
    "base/kustomization.yaml": """
resources: [things.yaml]
""",
    "base/things.yaml": """
apiVersion: apps/v1
kind: Deployment
metadata: {name: app, annotations: {a/b: x}}
spec:
  replicas: 1
  template:
    spec:
      initContainers: [{name: init, image: "registry:5000/tool:1.0"}]
      containers:
        - {name: one, image: shardgemm, args: [--a, --b]}
        - {name: two, image: other@sha256:abc}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: cfg}
data: {K: v, GONE: x}
""",
    "over/kustomization.yaml": """
resources: [../base]
images:
  - {name: shardgemm, newName: localhost/shardgemm, newTag: cpu}
  - {name: registry:5000/tool, newTag: "2.0"}
  - {name: other, newName: elsewhere/other}
replicas: [{name: app, count: 3}]
patches:
  - path: p.yaml
    target: {kind: Deployment, name: app}
  - target: {kind: ConfigMap, name: cfg}
    patch: |-
      - {op: replace, path: /data/K, value: w}
      - {op: remove, path: /data/GONE}
      - {op: copy, from: /data/K, path: /data/K2}
""",
    "over/p.yaml": """
- {op: add, path: /spec/template/spec/containers/0/args/-, value: --c}
- {op: add, path: /spec/template/spec/containers/0/args/0, value: --first}
- {op: replace, path: /metadata/annotations/a~1b, value: changed}
- {op: move, from: /spec/template/spec/containers/1/image, path: /spec/template/spec/containers/1/img}
- {op: move, from: /spec/template/spec/containers/1/img, path: /spec/template/spec/containers/1/image}
- {op: test, path: /spec/replicas, value: 1}
""",
}


def test_renderer_matches_kustomize_on_each_feature(tmp_path):
    for path, text in RENDERER_CASE.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text.lstrip())
    cfg, app = kustomize_render.render(str(tmp_path / "over"))
    assert cfg["data"] == {"K": "w", "K2": "w"}
    assert app["spec"]["replicas"] == 3
    assert app["metadata"]["annotations"] == {"a/b": "changed"}
    spec = app["spec"]["template"]["spec"]
    assert spec["initContainers"][0]["image"] == "registry:5000/tool:2.0"
    assert spec["containers"][0] == {"name": "one", "image": "localhost/shardgemm:cpu",
                                     "args": ["--first", "--a", "--b", "--c"]}
    assert spec["containers"][1]["image"] == "elsewhere/other@sha256:abc"
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here to compare with")
    out = subprocess.run([kubectl, "kustomize", str(tmp_path / "over")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert [cfg, app] == [d for d in yaml.safe_load_all(out.stdout) if d is not None]


@pytest.mark.parametrize("bad, why", [
    ("namePrefix: x-\n", "namePrefix not supported"),
    ("patches: [{path: p.yaml, target: {kind: Deployment, name: nope}}]\n", "no Deployment named nope"),
    ("patches: [{patch: '{spec: {replicas: 2}}', target: {kind: Deployment, name: app}}]\n",
     "strategic merge patches are not supported"),
    ("patches: [{patch: '[{op: replace, path: /spec/nope, value: 1}]', target: {kind: Deployment, name: app}}]\n",
     "nothing to replace"),
    ("replicas: [{name: nope, count: 2}]\n", "no workload named nope"),
])
def test_renderer_refuses_what_it_does_not_do(tmp_path, bad, why):
    for path, text in RENDERER_CASE.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text.lstrip())
    (tmp_path / "over" / "kustomization.yaml").write_text("resources: [../base]\n" + bad)
    with pytest.raises(kustomize_render.RenderError, match=why):
        kustomize_render.render(str(tmp_path / "over"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_document_is_valid_kubernetes(overlay):
    docs = render(overlay)
    assert {d["kind"] for d in docs} == {"ConfigMap", "Service", "Deployment", "StatefulSet"}
    errors = []
    for d in docs:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{d['kind']}/{d['metadata']['name']} against {version}: {e.message}"
                              f" at {'.'.join(map(str, e.path))}")
    assert not errors, "\n".join(errors)


def test_validation_is_strict():
    """A misspelt field (which Kubernetes would drop, or refuse) fails."""
    doc = yaml.safe_load(yaml.safe_dump(find(render("cpu"), "StatefulSet", "shardgemm-worker")))
    probe = doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["grcp"] = probe.pop("grpc")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinator_service_and_deployment(overlay):
    docs = render(overlay)
    svc = find(docs, "Service", "shardgemm-coordinator")
    ports = {p["port"]: p for p in svc["spec"]["ports"]}
    assert set(ports) == {50051, 9464}
    assert ports[9464]["name"] == "metrics"
    dep = find(docs, "Deployment", "shardgemm-coordinator")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # never two coordinators for one mesh
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    flags = flag_values(c)
    assert port_of(flags["listen"]) == 50051
    assert port_of(flags["metrics_listen"]) == 9464
    assert flags["mesh"] == "$(MESH)"
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    for p in svc["spec"]["ports"]:
        assert named[p["targetPort"]] == p["port"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_match_the_mesh(overlay):
    docs = render(overlay)
    sts = find(docs, "StatefulSet", "shardgemm-worker")
    mesh = config_data(docs)["MESH"]
    assert sts["spec"]["replicas"] == mesh_size(mesh), f"replicas against MESH={mesh}"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = find(docs, "Service", sts["spec"]["serviceName"])
    assert headless["metadata"]["name"] == "shardgemm-workers"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items()
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    flags = flag_values(c)
    assert flags["advertise_host"] == "$(POD_NAME).shardgemm-workers"
    pod_name = next(e for e in c["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    coordinator = find(docs, "Service", "shardgemm-coordinator")
    host, _, port = flags["coordinator"].rpartition(":")
    assert host == coordinator["metadata"]["name"]
    assert int(port) in {p["port"] for p in coordinator["spec"]["ports"]}
    assert port_of(flags["listen"]) == 50052
    # The staging port: served, named in the headless Service, advertised under the pod's name.
    assert flags["staging_port"] == "50053"
    assert flags["staging_advertise"] == "$(POD_NAME).shardgemm-workers:50053"
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    for p in headless["spec"]["ports"]:
        assert named[p["targetPort"]] == p["port"]
    assert flags["backend"] == {"cpu": "cpu", "gpu": "cuda"}[overlay]
    assert c["image"] == {"cpu": "localhost/shardgemm:cpu", "gpu": "localhost/shardgemm:cuda"}[overlay]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_workers_get_one_gpu_each(overlay):
    docs = render(overlay)
    for w, c in containers(docs):
        res = c["resources"]
        gpus = {k: res.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits")}
        if overlay == "gpu" and w["kind"] == "StatefulSet":
            assert gpus == {"requests": 1, "limits": 1}
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env.get("NCCL_NVLS_ENABLE") == "0"
        else:
            assert gpus == {"requests": None, "limits": None}, f"{w['metadata']['name']} asks for a GPU"


def _quantity_bytes(q):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q))
    assert m and (m.group(2) in units or not m.group(2)), f"memory quantity {q!r}"
    return int(m.group(1)) * units.get(m.group(2), 1)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_probes_and_security(overlay):
    docs = render(overlay)
    data = config_data(docs)
    for w, c in containers(docs):
        name = w["metadata"]["name"]
        flags = flag_values(c)
        grpc_port = port_of(flags["listen"])
        assert {"name": "grpc", "containerPort": grpc_port} in c["ports"], name
        # The probes ask the plaintext health-only port (the kubelet's gRPC probes speak no TLS).
        health_port = port_of(flags["health_listen"])
        assert {"name": "health", "containerPort": health_port} in c["ports"], name
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe].get("grpc") == {"port": health_port}, f"{name} {probe}"
        assert flags["tls_dir"] == "/etc/shardgemm/tls" and "insecure" not in flags, name
        res = c["resources"]
        for key in ("cpu", "memory"):
            assert key in res["requests"] and key in res["limits"], f"{name} {key}"
        if w["kind"] == "StatefulSet":
            # The worker refuses work past its budget instead of being killed.
            budget = int(data["MEMORY_BUDGET_MB"]) * 2**20
            assert budget < _quantity_bytes(res["limits"]["memory"]), f"{name}: budget over the limit"
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        pod = w["spec"]["template"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        ann = pod["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert ann["prometheus.io/port"] == "9464" == flag_values(c)["metrics_listen"].rpartition(":")[2]
        assert {"name": "metrics", "containerPort": 9464} in c["ports"]
        # TLS on: each pod mounts the mesh CA and its own certificate, the coordinator the token hashes.
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        role = "coordinator" if w["kind"] == "Deployment" else "worker"
        tls = volumes[mounts["/etc/shardgemm/tls"]]["secret"]
        assert tls["secretName"] == "shardgemm-tls" and not tls.get("optional"), name
        assert {i["key"] for i in tls["items"]} == {"ca.crt", f"{role}.crt", f"{role}.key"}, name
        if role == "coordinator":
            tokens = volumes[mounts["/etc/shardgemm/tokens"]]["secret"]
            assert tokens["secretName"] == "shardgemm-client-tokens" and not tokens.get("optional")
            assert flags["tokens_file"] == "/etc/shardgemm/tokens/tokens"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_comes_from_the_config(overlay):
    """$(VAR) that no env entry defines reaches the binary as the literal text."""
    docs = render(overlay)
    data = config_data(docs)
    for w, c in containers(docs):
        defined = {e["name"] for e in c.get("env", [])}
        for a in c.get("command", []) + c.get("args", []):
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
                assert var in defined, f"{w['metadata']['name']}: {a} uses {var}, which no env entry sets"
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                assert ref["name"] == CONFIG and ref["key"] in data, f"{w['metadata']['name']}: {ref}"
                assert not ref.get("optional")


def binary_flags(binary):
    path = os.path.join(BIN, binary)
    if not os.path.exists(path):
        pytest.skip(f"no {path}: `make build` first")
    out = subprocess.run([path, "--helpfull"], capture_output=True, text=True, timeout=60)
    flags = set(re.findall(r"^\s+--([A-Za-z0-9_]+)\s", out.stdout + out.stderr, re.M))
    assert flags, f"{binary} --helpfull listed no flags:\n{out.stdout}{out.stderr}"
    return flags


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_binaries_take_every_flag(overlay):
    missing = []
    for w, c in containers(render(overlay)):
        binary = os.path.basename(c["command"][0])
        assert c["command"][0] == f"/usr/local/bin/{binary}"
        have = binary_flags(binary)
        for flag in flag_values(c):
            if flag not in have:
                missing.append(f"{binary} --{flag}")
    assert not missing, "flags the binaries do not take: " + ", ".join(missing)


def _listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _loopback_args(container, data, overrides, pod_name="shardgemm-worker-0"):
    binary = os.path.basename(container["command"][0])
    env = env_values(container, data, pod_name)
    args = []
    for a in container["args"]:
        name = a[2:].partition("=")[0]
        args.append(f"--{name}={overrides[name]}" if name in overrides else expand(a, env))
    return [os.path.join(BIN, binary)] + args


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_configuration_starts_a_mesh(overlay, tmp_path, mesh_certs):
    """The coordinator and the StatefulSet's workers, run here with the rendered
    args and the ConfigMap's values; only the addresses become loopback ones
    (and the gpu overlay's workers run the CPU backend)."""
    docs = render(overlay)
    data = config_data(docs)
    (coord,) = pod_spec(docs, "Deployment", "shardgemm-coordinator")["containers"]
    sts = find(docs, "StatefulSet", "shardgemm-worker")
    (worker,) = sts["spec"]["template"]["spec"]["containers"]
    address = f"127.0.0.1:{free_port()}"
    procs = []

    def start(name, cmd):
        log = open(tmp_path / f"{name}.log", "w")
        procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))

    def logs():
        return "\n".join(f"--- {n}: {' '.join(p.args)}\n{(tmp_path / f'{n}.log').read_text()}" for n, p in procs)

    client = None
    try:
        start("coordinator", _loopback_args(coord, data, {
            "listen": address, "metrics_listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0",
            "tls_dir": mesh_certs, "tokens_file": os.path.join(mesh_certs, "tokens")}))
        deadline = time.time() + 30
        while not _listening(port_of(address)):
            assert procs[0][1].poll() is None and time.time() < deadline, "no coordinator:\n" + logs()
            time.sleep(0.05)
        overrides = {"coordinator": address, "listen": "127.0.0.1:0", "advertise_host": "127.0.0.1",
                     "metrics_listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "backend": "cpu",
                     "tls_dir": mesh_certs, "staging_port": "0", "staging_advertise": "",
                     "tokens_file": os.path.join(mesh_certs, "tokens")}
        for i in range(sts["spec"]["replicas"]):
            start(f"worker{i}", _loopback_args(worker, data, overrides, f"shardgemm-worker-{i}"))
        client = Client(address, timeout=30, tls_dir=mesh_certs)
        deadline = time.time() + 60
        info = None
        while time.time() < deadline:
            assert all(p.poll() is None for _, p in procs), "a process exited:\n" + logs()
            try:
                info = client.cluster_info()
                if info.ready:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.2)
        assert info is not None and info.ready, "the mesh did not become ready:\n" + logs()
        mesh = ",".join(f"{a.name}={a.size}" for a in info.mesh.axes)
        assert mesh == data["MESH"]
        assert info.workers_expected == len(info.workers) == sts["spec"]["replicas"]
        budget = int(data["MEMORY_BUDGET_MB"]) * 2**20
        assert all(w.memory_budget_bytes == budget for w in info.workers)
        assert all(w.staging_address for w in info.workers)  # the rendered flags serve the direct path
    finally:
        if client is not None:
            client.close()
        for _, p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
