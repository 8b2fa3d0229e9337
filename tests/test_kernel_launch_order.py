"""The quantize kernels' programmatic dependent launches (PDL), read off the
SASS of the objects the build compiled for sm_90a (no GPU needed).

Every quantize launch is its stream predecessor's programmatic dependent:
it may start while the kernel before it still runs, and must touch no
global memory that kernel may write before `griddepcontrol.wait` (ACQBULK
in SASS). The compiler is free to move a load above the wait where the PTX
lets it: ptxas hoisted the one-shot kernel's `ld.global.nc` loads of x
above a wait that sat behind a runtime branch (every one-shot kernel of
commit dea73d6), so x was read before the kernel that wrote it had
finished. This test reads the instruction order that ships.

The one exception is by design: current scaling's quantize pass (not fused)
follows its own amax pass, which started after all earlier work, so it
streams its first tile of x in (cp.async, LDGSTS) before its wait, which is
only for the amax (kernels/cuda/quantize_device.cuh, "Programmatic
dependent launch").

The check is on program order up to the first ACQBULK, which is where a
hoisted load lands; it does not follow branches.
"""
import functools
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OBJECTS = [
    "kernels/cuda/quantize_cu_quantize.o",
    "kernels/cuda/quantize_cu_quantize_small.o",
    "kernels/cuda/quantize_cu_quantize_oneshot.o",
]
# Kernels launched as programmatic dependents (quantize.cu, quantize_oneshot.cu).
DEPENDENT = re.compile(r"(QuantizeKernel|AmaxKernel|ZeroAmaxKernel|OneShotKernel)I?")
# QuantizeKernel<DT, MODE, FMT, FUSED, TR>: MODE 0 (current scaling), FUSED false.
CURRENT_QUANTIZE_PASS = re.compile(r"QuantizeKernelILi\dELi0ELi\dELb0E")
GLOBAL_MEMORY = re.compile(r"^(LDG|STG|ATOMG|ATOM|RED|REDG|LDGSTS)\b")


def _tool_dir():
    # nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (tools/requirements.txt).
    import nvidia

    for path in nvidia.__path__:
        for sub in ("cu13", "cu12"):
            d = os.path.join(path, sub, "bin")
            if os.path.exists(os.path.join(d, "cuobjdump")) and os.path.exists(os.path.join(d, "nvdisasm")):
                return d
    raise AssertionError("cuobjdump and nvdisasm not found (pip packages nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")


@functools.lru_cache(maxsize=None)
def _sass_functions(obj):
    """{kernel name: [instruction, ...]} of one object, predicates dropped."""
    tools = _tool_dir()
    env = dict(os.environ, PATH=tools + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", obj], check=True, capture_output=True,
                         text=True, env=env).stdout
    functions = {}
    for part in re.split(r"\n\s+Function : ", out)[1:]:
        name = part.split("\n", 1)[0].strip()
        instructions = []
        for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", part):
            instructions.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)))
        functions[name] = instructions
    return functions


def _objects():
    # $BAZEL names the build to read (a wrapper with its --output_base and
    # -c): asked for its bazel-bin; else the repository's bazel-bin link, or
    # bazel's own answer where there is none (built with a --symlink_prefix).
    bin_dir = os.path.join(ROOT, "bazel-bin")
    if "BAZEL" in os.environ or not os.path.isdir(bin_dir):
        bazel = os.environ.get("BAZEL", "bazel")
        bin_dir = subprocess.run([bazel, "info", "bazel-bin"], cwd=ROOT, check=True, capture_output=True,
                                 text=True).stdout.strip()
    paths = [os.path.join(bin_dir, o) for o in OBJECTS]
    missing = [p for p in paths if not os.path.exists(p)]
    assert not missing, f"not built (bazel build //kernels/cuda:quantize_cu): {missing}"
    return paths


@pytest.mark.parametrize("obj", OBJECTS)
def test_dependent_kernels_touch_no_global_memory_before_their_wait(obj):
    (path,) = [p for p in _objects() if p.endswith(obj)]
    functions = _sass_functions(path)
    dependents = {name: ins for name, ins in functions.items() if DEPENDENT.search(name)}
    assert dependents, f"no quantize kernels found in {obj}"
    problems = []
    for name, ins in dependents.items():
        waits = [i for i, s in enumerate(ins) if s.startswith("ACQBULK")]
        if not waits:
            problems.append(f"{name}: no griddepcontrol.wait (ACQBULK)")
            continue
        allowed = {"LDGSTS"} if CURRENT_QUANTIZE_PASS.search(name) else set()
        early = [s for s in ins[: waits[0]] if GLOBAL_MEMORY.match(s) and GLOBAL_MEMORY.match(s).group(1) not in allowed]
        if early:
            problems.append(f"{name}: {len(early)} global memory instructions before its first wait, e.g. {early[0]}")
    assert not problems, "\n".join(problems)


def test_the_current_quantize_pass_loads_its_first_tile_before_its_wait():
    """The exception above is taken, not only allowed: were the loads behind
    the wait, the overlap with the amax pass would be lost (a speed loss the
    GPU tests cannot see)."""
    for obj in ("quantize_cu_quantize.o", "quantize_cu_quantize_small.o"):  # both parameter sizes
        (path,) = [p for p in _objects() if p.endswith(obj)]
        functions = _sass_functions(path)
        passes = {n: ins for n, ins in functions.items() if CURRENT_QUANTIZE_PASS.search(n)}
        assert passes, f"no current-scaling quantize pass found in {obj}"
        _check_loads_first(passes)


def _check_loads_first(passes):
    for name, ins in passes.items():
        first_wait = next(i for i, s in enumerate(ins) if s.startswith("ACQBULK"))
        assert any(s.startswith("LDGSTS") for s in ins[:first_wait]), name
