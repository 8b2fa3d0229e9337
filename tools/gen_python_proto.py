#!/usr/bin/env python3
"""Generates the Python protobuf / gRPC modules for the Python client and the
integration tests into client/python/shardgemm_pb (git-ignored)."""
import os
import sys

from grpc_tools import protoc

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out = os.path.join(root, "client", "python", "shardgemm_pb")
os.makedirs(out, exist_ok=True)
proto = os.path.join(root, "proto", "shardgemm.proto")
stamp = os.path.join(out, ".stamp")
if os.path.exists(stamp) and os.path.getmtime(stamp) >= os.path.getmtime(proto):
    sys.exit(0)
rc = protoc.main(["protoc", f"-I{os.path.join(root, 'proto')}", f"--python_out={out}",
                  f"--grpc_python_out={out}", proto])
if rc != 0:
    sys.exit(rc)
# grpc_tools emits a top-level import; make it package-relative.
grpc_mod = os.path.join(out, "shardgemm_pb2_grpc.py")
text = open(grpc_mod).read().replace("import shardgemm_pb2 as", "from . import shardgemm_pb2 as")
open(grpc_mod, "w").write(text)
open(os.path.join(out, "__init__.py"), "w").close()
open(stamp, "w").close()
