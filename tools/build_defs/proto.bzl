"""C++ protobuf + gRPC code generation with Debian's protoc and grpc_cpp_plugin."""

def cc_grpc_proto_library(name, src, deps = [], **kwargs):
    """Generates <src>.pb.{h,cc} and <src>.grpc.pb.{h,cc} and a cc_library over them."""
    base = src[:-len(".proto")]
    outs = [base + ".pb.h", base + ".pb.cc", base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_gen",
        srcs = [src],
        outs = outs,
        cmd = ("protoc --proto_path=. --cpp_out=$(GENDIR) --grpc_out=$(GENDIR) " +
               "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin $(location %s)") % src,
    )
    native.cc_library(
        name = name,
        srcs = [base + ".pb.cc", base + ".grpc.pb.cc"],
        hdrs = [base + ".pb.h", base + ".grpc.pb.h"],
        deps = deps + ["//third_party:grpc"],
        **kwargs
    )
