"""The generated protobuf / gRPC modules (shardgemm/_pb, made from
proto/shardgemm.proto when the package is built, or by `make build` in the
repository)."""
try:
    from ._pb import shardgemm_pb2 as pb
    from ._pb import shardgemm_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - a checkout before `make build`
    raise ImportError("shardgemm's generated protobuf modules are missing: install the package "
                      "(pip install ./client/python) or run `make build` (tools/gen_python_proto.py) "
                      "in the repository") from e

__all__ = ["pb", "pb_grpc"]
