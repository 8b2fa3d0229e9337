"""The Python client as a package: `pip install ./client/python` into a fresh
virtual environment (offline: --no-index, --no-build-isolation, --no-deps,
the PyPI packages already installed reused through --system-site-packages),
then a script run with that environment's python from a folder outside the
repository against a real mesh: NumPy and DLPack operands against a NumPy
reference, the asyncio client, put/get round trips with progress, errors
carrying their codes; the READMEs' examples (shared memory's included)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

from conftest import ROOT

SCRIPT = textwrap.dedent('''
    import asyncio, importlib.util, json, os, sys, warnings
    import grpc, ml_dtypes, numpy as np
    import shardgemm, shardgemm.aio

    address, repo = sys.argv[1], sys.argv[2]
    facts = {"file": shardgemm.__file__, "version": shardgemm.__version__}
    assert not os.path.abspath(shardgemm.__file__).startswith(repo + os.sep), shardgemm.__file__
    for name in ("shardgemm_client", "shardgemm_pb"):  # the repository's, not the package's
        assert importlib.util.find_spec(name) is None, name

    class Foreign:
        """An array of another library: only the DLPack protocol."""
        def __init__(self, a):
            self.a = a
        def __dlpack__(self, *args, **kwargs):
            return self.a.__dlpack__(*args, **kwargs)
        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    def reference(lhs, rhs, sizes):
        out, row = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64), 0
        for g, n in enumerate(sizes):
            out[row:row + n] = lhs[row:row + n].astype(np.float64) @ rhs[g].astype(np.float64)
            row += n
        return out

    rng = np.random.default_rng(7)
    lhs = rng.standard_normal((96, 64)).astype(np.float32)
    rhs = rng.standard_normal((4, 64, 48)).astype(np.float32)
    sizes = [30, 0, 40, 26]
    ref = reference(lhs, rhs, sizes)
    w = rng.standard_normal((4, 256, 320)).astype(np.float32)  # 1.25 MiB: two chunks each way

    with shardgemm.Client(address, timeout=30) as c:
        assert c.cluster_info().ready
        out, plan = c.grouped_gemm(lhs, rhs, sizes, include_plan=True, request_id="pkg-gemm-1")
        assert isinstance(out, np.ndarray) and out.shape == (96, 48) and out.dtype == np.float32
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
        assert c.last_request_id == "pkg-gemm-1" and plan.rule, plan
        facts["max_err"] = float(np.max(np.abs(out - ref)))

        # DLPack operands (NumPy's own __dlpack__ behind an object that is no ndarray)
        out2, _ = c.grouped_gemm(Foreign(lhs), Foreign(rhs), Foreign(np.asarray(sizes, np.int64)))
        np.testing.assert_array_equal(out2, out)

        # put / get round trips, sharded over ep, with progress
        seen = []
        r = c.put("w", Foreign(w), spec="(ep, None, None)", progress=lambda done, total: seen.append((done, total)))
        assert r.bytes == w.nbytes and len(seen) == 2 and seen[-1] == (w.nbytes, w.nbytes), (r, seen)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # tqdm is installed here: a bar, no warning
            back = c.get("w", progress=True)
        np.testing.assert_array_equal(back, w)
        hidden = {name: sys.modules.pop(name, None) for name in ("tqdm", "tqdm.auto")}
        sys.modules.update({"tqdm": None, "tqdm.auto": None})  # as if tqdm were not installed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            np.testing.assert_array_equal(c.get("w", progress=True), w)  # no bar, one warning, the data
        assert [str(x.message) for x in caught if "needs tqdm" in str(x.message)], caught
        for name, module in hidden.items():
            sys.modules.pop(name)
            if module is not None:
                sys.modules[name] = module
        got = []
        back = c.get("w", progress=lambda done, total: got.append((done, total)))
        np.testing.assert_array_equal(back, w)
        assert got[-1] == (w.nbytes, w.nbytes) and len(got) >= 2, got
        b16 = w[:2, :8, :16].astype(ml_dtypes.bfloat16)
        c.put("b16", b16)
        assert c.get("b16").view(np.uint16).tobytes() == b16.view(np.uint16).tobytes()
        c.put("experts", rhs)
        out3, _ = c.grouped_gemm(lhs, "experts", sizes, keep_output_as="y")  # resident in, resident out
        assert out3 is None and sorted(t.name for t in c.list()) == ["b16", "experts", "w", "y"]
        np.testing.assert_array_equal(c.get("y"), out)

        # errors: a ShardGemmError subclass with the code and the server's words
        try:
            c.get("no-such-tensor")
            raise AssertionError("no error")
        except shardgemm.NotFoundError as e:
            assert isinstance(e, shardgemm.ShardGemmError) and e.code == grpc.StatusCode.NOT_FOUND, e
            assert "no-such-tensor" in e.details and isinstance(e.__cause__, grpc.RpcError), e.details
            facts["not_found"] = str(e)
        try:
            c.put("w", w)
            raise AssertionError("no error")
        except shardgemm.AlreadyExistsError as e:
            assert e.code == grpc.StatusCode.ALREADY_EXISTS
        try:
            c.grouped_gemm(lhs, rhs, [30, 40, 26])  # 3 sizes for 4 groups
            raise AssertionError("no error")
        except shardgemm.InvalidArgumentError as e:
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "group_sizes" in e.details, e.details
            assert e.request_id, e  # the id the coordinator gave the failed call, for its logs
        try:
            c.grouped_gemm(lhs.astype(np.float64), rhs, sizes)
            raise AssertionError("no error")
        except ValueError as e:  # refused before anything is sent
            assert "float64" in str(e)

        # torch out: a torch tensor where torch is importable, else a clear ImportError
        if importlib.util.find_spec("torch") is None:
            try:
                c.grouped_gemm(lhs, rhs, sizes, output="torch")
                raise AssertionError("no error")
            except ImportError as e:
                assert "shardgemm[torch]" in str(e)
            facts["torch"] = "absent"
        else:
            import torch
            t, _ = c.grouped_gemm(torch.from_numpy(lhs), torch.from_numpy(rhs), sizes, output="torch")
            assert isinstance(t, torch.Tensor) and np.array_equal(t.numpy(), out)
            facts["torch"] = torch.__version__

    async def main():
        async with shardgemm.aio.Client(address, timeout=30) as a:
            assert (await a.cluster_info()).ready
            (o1, _), (o2, _) = await asyncio.gather(a.grouped_gemm(lhs, rhs, sizes, request_id="pkg-aio"),
                                                    a.grouped_gemm(Foreign(lhs), "experts", sizes))
            np.testing.assert_allclose(o1, ref, rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(o2, o1)
            await a.put("v", w, spec="(ep, None, None)", progress=True)
            np.testing.assert_array_equal(await a.get("v"), w)
            await a.delete("v")
            try:
                await a.get("v")
                raise AssertionError("no error")
            except shardgemm.NotFoundError as e:
                assert e.code == grpc.StatusCode.NOT_FOUND and "v" in e.details
            assert sorted(t.name for t in await a.list()) == ["b16", "experts", "w", "y"]
            return a.last_request_id

    facts["aio_last_request_id"] = asyncio.run(asyncio.wait_for(main(), 60))
    print(json.dumps(facts))
''')


def readme_python(path, after=None):
    """The ```python blocks of a README (those after the heading `after`)."""
    text = open(path).read()
    if after is not None:
        text = text[text.index(after):]
    blocks, start = [], text.find("```python\n")
    while start >= 0:
        end = text.index("```", start + 10)
        blocks.append(text[start + 10:end])
        start = text.find("```python\n", end + 3)
    return blocks


def run(cmd, timeout, **kwargs):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    return r


def test_the_installed_package_serves_numpy_dlpack_and_asyncio_outside_the_repository(cluster_factory, tmp_path):
    # The package's source as a checkout has it (client/python and proto/), copied so that
    # the in-tree build's outputs (build/, *.egg-info, shardgemm/_pb) stay out of the checkout
    # and the wheel is shown to make its protobuf modules from the proto itself.
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "client", "python"), src / "client" / "python",
                    ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "_pb",
                                                  "shardgemm_pb"))
    os.makedirs(src / "proto")
    shutil.copy(os.path.join(ROOT, "proto", "shardgemm.proto"), src / "proto")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONNOUSERSITE="1")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], 60, env=env)
    py = str(venv / "bin" / "python")
    run([py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "./client/python"], 120,
        cwd=src, env=env)
    site = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 30, env=env).stdout.strip()
    installed = sorted(os.listdir(site))
    assert "shardgemm" in installed and not {"shardgemm_client.py", "shardgemm_pb"} & set(installed), installed
    package = os.listdir(os.path.join(site, "shardgemm"))
    assert {"py.typed", "aio.py", "errors.py", "_pb"} <= set(package), package
    assert {"shardgemm_pb2.py", "shardgemm_pb2.pyi", "shardgemm_pb2_grpc.py"} <= \
        set(os.listdir(os.path.join(site, "shardgemm", "_pb")))

    cl = cluster_factory(mesh="ep=2", workers=2, coordinator_flags=["--shared_memory"])  # the README's region
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "check.py").write_text(SCRIPT)
    r = run([py, "check.py", cl.address, ROOT], 90, cwd=outside, env=env)
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    assert facts["file"].startswith(site), facts
    assert "NOT_FOUND" in facts["not_found"], facts
    assert facts["max_err"] < 1e-3, facts

    # The READMEs' examples, as written but for the address, with the installed package.
    examples = [(os.path.join(ROOT, "README.md"), readme_python(os.path.join(ROOT, "README.md"),
                                                                "## The Python client")),
                (os.path.join(ROOT, "client", "python", "README.md"),
                 readme_python(os.path.join(ROOT, "client", "python", "README.md")))]
    assert [len(blocks) for _, blocks in examples] == [3, 2], examples
    for readme, blocks in examples:
        for i, block in enumerate(blocks):
            assert '"127.0.0.1:50051"' in block, block
            if "import torch" in block and facts["torch"] == "absent":
                continue  # marked in the README as needing PyTorch
            if 'device="cuda"' in block:
                continue  # CUDA arrays need CUDA workers on a GPU host: tests/test_cuda_ipc_gpu.py runs that path
            path = outside / f"readme_{os.path.basename(os.path.dirname(readme))}_{i}.py"
            path.write_text(block.replace('"127.0.0.1:50051"', repr(cl.address)))
            r = run([py, str(path)], 60, cwd=outside, env=env)
            if "np.allclose" in block:
                assert r.stdout.strip() == "True", (readme, block, r.stdout)
