"""Generates shardgemm's protobuf / gRPC modules (and their .pyi stubs) from
proto/shardgemm.proto with grpcio-tools. Used by setup.py when the package is
built (pip install ./client/python) and by tools/gen_python_proto.py (`make
build`) for the in-tree package. Not part of the installed package."""
import os
import re
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# In the repository the proto is two folders up; an sdist carries a copy in proto/.
PROTO_CANDIDATES = (os.path.join(HERE, "proto", "shardgemm.proto"),
                    os.path.join(HERE, "..", "..", "proto", "shardgemm.proto"))
MODULES = ("shardgemm_pb2.py", "shardgemm_pb2.pyi", "shardgemm_pb2_grpc.py")


def find_proto():
    for path in PROTO_CANDIDATES:
        if os.path.exists(path):
            return os.path.normpath(path)
    return None


def generate(proto, out):
    """Writes the modules of `proto` into the folder `out` as a package whose
    gRPC module imports its messages relatively. Files whose text is
    unchanged are left alone (a process that imported them keeps them)."""
    from grpc_tools import protoc  # a build requirement (pyproject.toml)

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{os.path.dirname(proto)}", f"-I{protoc_include()}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", proto]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        texts = {}
        for name in MODULES:
            with open(os.path.join(tmp, name)) as f:
                texts[name] = f.read()
    # grpc_tools emits a top-level import; inside a package it must be relative.
    texts["shardgemm_pb2_grpc.py"] = re.sub(r"^import shardgemm_pb2 as", "from . import shardgemm_pb2 as",
                                            texts["shardgemm_pb2_grpc.py"], flags=re.M)
    texts["__init__.py"] = '"""Generated from proto/shardgemm.proto by grpcio-tools: do not edit."""\n'
    os.makedirs(out, exist_ok=True)
    for name, text in texts.items():
        path = os.path.join(out, name)
        if os.path.exists(path):
            with open(path) as f:
                if f.read() == text:
                    continue
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def protoc_include():
    """grpcio-tools' copy of the well-known protos (google/protobuf/*.proto)."""
    import grpc_tools

    return os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")


def generated_versions(out):
    """(grpcio, protobuf) versions the generated code was made for: the
    runtime must be at least these (the modules check at import)."""
    with open(os.path.join(out, "shardgemm_pb2_grpc.py")) as f:
        grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", f.read())
    with open(os.path.join(out, "shardgemm_pb2.py")) as f:
        pb_version = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
                               r"(\d+),\s*(\d+),\s*(\d+),", f.read())
    return (grpc_version.group(1) if grpc_version else None,
            tuple(int(x) for x in pb_version.groups()) if pb_version else None)
