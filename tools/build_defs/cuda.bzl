"""nvcc for sm_90a from a genrule; the object files feed a cc_library.

Every build compiles the CUDA sources, so a CUDA compile error fails CI even
on machines without a GPU.
"""

NVCC = "/usr/local/cuda/bin/nvcc"
NVCC_FLAGS = "-std=c++17 -O3 -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo"

def cuda_library(name, srcs, hdrs = [], deps = [], extra_nvcc_flags = "", **kwargs):
    """srcs: .cu files; hdrs: headers they or their users include."""
    objs = []
    for src in srcs:
        obj = name + "_" + src.replace("/", "_").replace(".cu", ".o")
        native.genrule(
            name = obj.replace(".o", "_nvcc"),
            srcs = [src] + hdrs + native.glob(["**/*.h", "**/*.cuh"], allow_empty = True),
            outs = [obj],
            cmd = "%s %s %s -I. -I$(GENDIR) -c $(location %s) -o $@" % (NVCC, NVCC_FLAGS, extra_nvcc_flags, src),
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        **kwargs
    )
