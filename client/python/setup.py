"""Build hooks for the shardgemm package (metadata: pyproject.toml).

build_py compiles proto/shardgemm.proto (the repository's, or the copy an
sdist carries) into the build's shardgemm/_pb with grpcio-tools, so the wheel
holds the generated modules and works outside the repository. The source
tree is left as it is: the checkout's own shardgemm/_pb is `make build`'s
(tools/gen_python_proto.py), made with the repository's pinned grpcio-tools,
and must not be replaced by the output of whatever grpcio-tools an isolated
build brought. The install requirements follow the versions the generated
code checks for at import. sdist carries the proto and _build_protos.py."""
import functools
import os
import shutil
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _build_protos  # noqa: E402

IN_TREE = os.path.join(HERE, "shardgemm", "_pb")


def _generate(out):
    """shardgemm/_pb into `out`: from the proto when there is one, else a
    copy of the generated modules already in the tree."""
    proto = _build_protos.find_proto()
    if proto is not None:
        _build_protos.generate(proto, out)
    elif os.path.exists(os.path.join(IN_TREE, "shardgemm_pb2.py")):
        shutil.copytree(IN_TREE, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    else:
        raise RuntimeError("shardgemm.proto not found (looked in " + ", ".join(_build_protos.PROTO_CANDIDATES) +
                           ") and no generated shardgemm/_pb")


class BuildPy(build_py):
    def run(self):
        # build/lib outlives a build in the checkout: a module removed from the
        # source must not ride along in the next wheel.
        shutil.rmtree(os.path.join(self.build_lib, "shardgemm"), ignore_errors=True)
        super().run()
        _generate(os.path.join(self.build_lib, "shardgemm", "_pb"))


class Sdist(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        proto = _build_protos.find_proto()
        if proto is not None:
            os.makedirs(os.path.join(base_dir, "proto"), exist_ok=True)
            shutil.copy(proto, os.path.join(base_dir, "proto", "shardgemm.proto"))
        shutil.copy(os.path.join(HERE, "_build_protos.py"), base_dir)


@functools.lru_cache(maxsize=None)
def _install_requires():
    with tempfile.TemporaryDirectory() as tmp:
        _generate(os.path.join(tmp, "_pb"))
        grpc_version, pb_version = _build_protos.generated_versions(os.path.join(tmp, "_pb"))
    requires = ["numpy>=1.22", "ml_dtypes>=0.3.2"]
    requires.append(f"grpcio>={grpc_version}" if grpc_version else "grpcio")
    if pb_version:
        requires.append(f"protobuf>={'.'.join(map(str, pb_version))},<{pb_version[0] + 1}")
    else:
        requires.append("protobuf")
    return requires


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist}, install_requires=_install_requires())
