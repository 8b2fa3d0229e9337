"""Compatibility module for the repository's tests and tools: the Python
client is the `shardgemm` package beside this file (pip install
./client/python; see its README).

    from shardgemm_client import Client, pb, to_tensor, from_tensor

re-exports the package's names. The differences: shardgemm_client.Client
raises grpc.RpcError (e.code(), e.details()) on a failed call, as this module
always did, where shardgemm.Client raises shardgemm.ShardGemmError
subclasses (e.code, e.details) (a call sent on a call_socket raises those
here too: it never was a gRPC call); and its grouped_gemm takes the inline path
unless asked for path="direct" (the repository's tests of the inline path
stay what they were). In a checkout the generated protobuf modules
come from `make build` (tools/gen_python_proto.py).
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import shardgemm  # noqa: E402
from shardgemm import ShardGemmError, aio, errors  # noqa: E402,F401
from shardgemm._common import CHUNK as _CHUNK  # noqa: E402,F401
from shardgemm._common import MAX_MESSAGE as _MAX_MESSAGE  # noqa: E402,F401
from shardgemm._common import metadata as _metadata  # noqa: E402,F401
from shardgemm._convert import NUMPY_DTYPES, PROTO_DTYPES, SCALING, as_numpy, from_tensor, to_tensor  # noqa: E402,F401
from shardgemm._proto import pb, pb_grpc  # noqa: E402,F401
from shardgemm.errors import REQUEST_ID_KEY  # noqa: E402,F401


class Client(shardgemm.Client):
    """shardgemm.Client whose failed calls raise grpc.RpcError, as before,
    and whose grouped_gemm is inline unless path="direct"."""

    _translate_errors = False
    _default_path = "inline"
