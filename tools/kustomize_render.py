#!/usr/bin/env python3
"""Renders a kustomization the way `kubectl kustomize DIR` does, for the subset
that deploy/k8s uses: `resources` (files and directories holding a
kustomization), `patches` (JSON 6902 patches from a file or inline, each with
a target kind and name), `replicas` and `images`. Anything else in a
kustomization is refused, never ignored: extend this (and its test) or use
kubectl.

Why it exists: CI reaches only Debian's and PyPI's packages, and neither has a
kubectl with a current kustomize (Debian's kubernetes-client is 1.20, with
kustomize v2.0.3, and its /usr/bin/kubectl collides with other kubectl
packages). tests/test_k8s_manifests.py renders with this, and where `kubectl`
is installed checks that it renders the same.

    python3 tools/kustomize_render.py deploy/k8s/overlays/cpu [> out.yaml]
"""
import copy
import os
import sys

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "replicas", "images"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "ReplicaSet", "ReplicationController"}

# kustomize's legacy output order (api/resid/gvk.go): these kinds first, in
# this order, then every other kind, then the webhook configurations.
ORDER_FIRST = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
    "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap",
    "Secret", "Endpoints", "Service", "LimitRange", "PriorityClass", "PersistentVolume",
    "PersistentVolumeClaim", "Deployment", "StatefulSet", "CronJob", "PodDisruptionBudget",
]
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]


class RenderError(Exception):
    pass


def _kustomization_file(directory):
    for name in KUSTOMIZATION_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise RenderError(f"{directory}: no kustomization.yaml")


def _load_documents(path):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "metadata" not in d:
            raise RenderError(f"{path}: a document without kind or metadata")
    return docs


# --- JSON 6902 -----------------------------------------------------------

def _pointer(path):
    if path == "":
        return []
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer '{path}' does not start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container, token, path, allow_end=False):
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token[0] == "0"):
        raise RenderError(f"'{path}': '{token}' is not a list index")
    i = int(token)
    if i > len(container) or (i == len(container) and not allow_end):
        raise RenderError(f"'{path}': index {i} past the end of a list of {len(container)}")
    return i


def _parent(doc, tokens, path):
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, dict):
            if token not in node:
                raise RenderError(f"'{path}': no '{token}'")
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token, path)]
        else:
            raise RenderError(f"'{path}': '{token}' is inside a scalar")
    return node


def _get(doc, path):
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise RenderError(f"'{path}': no '{last}'")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, path)]
    raise RenderError(f"'{path}': inside a scalar")


def _remove(doc, path):
    tokens = _pointer(path)
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise RenderError(f"'{path}': nothing to remove")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, path))
    raise RenderError(f"'{path}': inside a scalar")


def _add(doc, path, value, replace=False):
    tokens = _pointer(path)
    if not tokens:
        raise RenderError("patching the whole document is not supported")
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise RenderError(f"'{path}': nothing to replace")
        parent[last] = value
    elif isinstance(parent, list):
        if replace:
            parent[_index(parent, last, path)] = value
        else:
            parent.insert(_index(parent, last, path, allow_end=True), value)
    else:
        raise RenderError(f"'{path}': inside a scalar")


def apply_json6902(doc, ops):
    """Applies RFC 6902 operations to doc in place."""
    if not isinstance(ops, list):
        raise RenderError("a patch that is not a list of JSON 6902 operations "
                          "(strategic merge patches are not supported)")
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise RenderError(f"not a JSON 6902 operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise RenderError(f"{kind} '{path}' has no value")
        if kind == "add":
            _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "replace":
            _add(doc, path, copy.deepcopy(op["value"]), replace=True)
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "move":
            _add(doc, path, _remove(doc, op["from"]))
        elif kind == "copy":
            _add(doc, path, copy.deepcopy(_get(doc, op["from"])))
        elif kind == "test":
            if _get(doc, path) != op["value"]:
                raise RenderError(f"test '{path}' failed")
        else:
            raise RenderError(f"unknown JSON 6902 op '{kind}'")


# --- transformers --------------------------------------------------------

def _select(docs, target, what):
    unsupported = set(target) - {"kind", "name", "group", "version"}
    if unsupported or "kind" not in target or "name" not in target:
        raise RenderError(f"{what}: a target is kind and name (and group/version), got {target!r}")
    hits = [d for d in docs if d["kind"] == target["kind"] and d["metadata"].get("name") == target["name"]
            and ("group" not in target or d["apiVersion"].rpartition("/")[0] == target["group"])
            and ("version" not in target or d["apiVersion"].rpartition("/")[2] == target["version"])]
    if not hits:
        raise RenderError(f"{what}: no {target['kind']} named {target['name']}")
    return hits


def _split_image(image):
    """'a/b:t' -> ('a/b', ':t'); 'a/b@sha256:x' -> ('a/b', '@sha256:x')."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _set_images(node, entries):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    if isinstance(c, dict) and isinstance(c.get("image"), str):
                        c["image"] = _new_image(c["image"], entries)
            _set_images(value, entries)
    elif isinstance(node, list):
        for v in node:
            _set_images(v, entries)


def _new_image(image, entries):
    name, suffix = _split_image(image)
    for e in entries:
        if e["name"] != name:
            continue
        name = e.get("newName", name)
        if "digest" in e:
            suffix = "@" + e["digest"]
        elif "newTag" in e:
            suffix = ":" + str(e["newTag"])
        return name + suffix
    return image


def render_dir(directory):
    """The documents a kustomization directory renders to, unsorted."""
    path = _kustomization_file(directory)
    with open(path) as f:
        k = yaml.safe_load(f) or {}
    unknown = set(k) - SUPPORTED_KEYS
    if unknown:
        raise RenderError(f"{path}: {', '.join(sorted(unknown))} not supported by "
                          f"tools/kustomize_render.py (supported: {', '.join(sorted(SUPPORTED_KEYS))})")
    docs = []
    for entry in k.get("resources", []):
        p = os.path.normpath(os.path.join(directory, entry))
        docs.extend(render_dir(p) if os.path.isdir(p) else _load_documents(p))
    seen = set()
    for d in docs:
        key = (d["apiVersion"], d["kind"], d["metadata"].get("namespace"), d["metadata"].get("name"))
        if key in seen:
            raise RenderError(f"{path}: {d['kind']} {d['metadata'].get('name')} defined twice")
        seen.add(key)

    for i, p in enumerate(k.get("patches", [])):
        what = f"{path}: patches[{i}]"
        if set(p) - {"path", "patch", "target"} or ("path" in p) == ("patch" in p) or "target" not in p:
            raise RenderError(f"{what}: one of path or patch, and a target")
        if "path" in p:
            with open(os.path.join(directory, p["path"])) as f:
                ops = yaml.safe_load(f)
        else:
            ops = yaml.safe_load(p["patch"])
        for d in _select(docs, p["target"], what):
            try:
                apply_json6902(d, ops)
            except RenderError as e:
                raise RenderError(f"{what} on {d['kind']} {d['metadata']['name']}: {e}") from None

    for r in k.get("replicas", []):
        hits = [d for d in docs if d["kind"] in WORKLOAD_KINDS and d["metadata"].get("name") == r["name"]]
        if not hits:
            raise RenderError(f"{path}: replicas: no workload named {r['name']}")
        for d in hits:
            d.setdefault("spec", {})["replicas"] = int(r["count"])

    images = k.get("images", [])
    for e in images:
        if "name" not in e or set(e) - {"name", "newName", "newTag", "digest"}:
            raise RenderError(f"{path}: images: name with newName/newTag/digest, got {e!r}")
    if images:
        _set_images(docs, images)
    return docs


def _order(doc):
    kind = doc["kind"]
    if kind in ORDER_FIRST:
        rank = ORDER_FIRST.index(kind)
    elif kind in ORDER_LAST:
        rank = len(ORDER_FIRST) + 1 + ORDER_LAST.index(kind)
    else:
        rank = len(ORDER_FIRST)
    meta = doc["metadata"]
    return (rank, doc["apiVersion"], kind, meta.get("namespace", ""), meta.get("name", ""))


def render(directory):
    """The documents `kubectl kustomize directory` prints, in its order."""
    return sorted(render_dir(directory), key=_order)


def dump(docs):
    return yaml.safe_dump_all(docs, sort_keys=True, default_flow_style=False, explicit_start=False)


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        sys.stdout.write(dump(render(argv[1])))
    except (RenderError, OSError, yaml.YAMLError) as e:
        print(f"kustomize_render: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
