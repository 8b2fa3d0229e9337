"""Build hooks for the shardgemm package (metadata: pyproject.toml).

build_py compiles proto/shardgemm.proto (the repository's, or the copy an
sdist carries) into shardgemm/_pb with grpcio-tools, so the wheel holds the
generated modules and works outside the repository; sdist carries the proto.
The install requirements follow the versions the generated code needs."""
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _build_protos  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
IN_TREE = os.path.join(HERE, "shardgemm", "_pb")


def _ensure_generated():
    """The in-tree shardgemm/_pb, made from the proto when there is one
    (always: a stale copy must not be packaged), else the one already there."""
    proto = _build_protos.find_proto()
    if proto is not None:
        _build_protos.generate(proto, IN_TREE)
    elif not os.path.exists(os.path.join(IN_TREE, "shardgemm_pb2.py")):
        raise RuntimeError("shardgemm.proto not found (looked in " + ", ".join(_build_protos.PROTO_CANDIDATES) +
                           ") and no generated shardgemm/_pb")
    return IN_TREE


class BuildPy(build_py):
    def run(self):
        _ensure_generated()
        # build/lib outlives a build in the checkout: a module removed from the
        # source must not ride along in the next wheel.
        shutil.rmtree(os.path.join(self.build_lib, "shardgemm"), ignore_errors=True)
        super().run()


class Sdist(sdist):
    def run(self):
        _ensure_generated()
        super().run()

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        proto = _build_protos.find_proto()
        if proto is not None:
            os.makedirs(os.path.join(base_dir, "proto"), exist_ok=True)
            shutil.copy(proto, os.path.join(base_dir, "proto", "shardgemm.proto"))
        shutil.copy(os.path.join(HERE, "_build_protos.py"), base_dir)


def _install_requires():
    grpc_version, pb_version = _build_protos.generated_versions(_ensure_generated())
    requires = ["numpy>=1.22", "ml_dtypes>=0.3.2"]
    requires.append(f"grpcio>={grpc_version}" if grpc_version else "grpcio")
    if pb_version:
        requires.append(f"protobuf>={'.'.join(map(str, pb_version))},<{pb_version[0] + 1}")
    else:
        requires.append("protobuf")
    return requires


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist}, install_requires=_install_requires())
