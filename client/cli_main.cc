// shardgemm: the command-line client.
//
//   shardgemm cluster
//   shardgemm plan   --lhs '4096x7168@((dp,fsdp,ep),None)' --rhs '8x7168x2048@(ep,fsdp,None)'
//                    --group-sizes '32@((dp,fsdp,ep),)' [--mesh dp=2,fsdp=2,ep=2 [--roles ...]] [--json]
//   shardgemm gemm   --lhs a.npy|MxK[@SPEC]|resident:NAME --rhs ... [--group-sizes 3,5,0,8[@SPEC]]
//                    [--groups G --seed S] [--check] [--out out.npy] [--request req.json]
//                    FP8: [--lhs_scale_inv F|resident:N] [--rhs_scale_inv F|resident:N] [--scaling S]
//                    [--quantize_lhs e4m3]
//   shardgemm quantize ... [--keep_data_as NAME --keep_scale_as NAME] [--flatten_axis A]
//   shardgemm put NAME --data w.npy|SHAPE [--dtype bf16] [--spec SPEC]
//   shardgemm get NAME --out w.npy
//   shardgemm delete NAME
//   shardgemm ls
#include <fstream>
#include <map>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/connect_flags.h"
#include "client/npy.h"
#include "client/reference.h"
#include "kernels/fp8.h"
#include "google/protobuf/util/json_util.h"
#include "proto/tensor_codec.h"
#include "planner/planner.h"
#include "kernels/quantize_assembly.h"
#include "proto/plan_codec.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051",
          "coordinator address: HOST:PORT, or unix:PATH for its --client_socket");
ABSL_FLAG(std::string, request_id, "",
          "id sent as x-request-id metadata, found in the coordinator's and workers' log lines "
          "(default: the coordinator makes one; gemm prints it)");
ABSL_FLAG(std::string, call_socket, "",
          "gemm, quantize: send the call as a frame on the coordinator's --call_socket at this path (same host "
          "and user) instead of gRPC");
ABSL_FLAG(std::string, mesh, "", "plan offline on this mesh instead of asking the coordinator");
ABSL_FLAG(std::string, roles, "", "roles for --mesh, e.g. 'dp=data,ep=expert'");
ABSL_FLAG(std::string, lhs, "", "lhs: FILE.npy, SHAPE (random, e.g. 512x256) or resident:NAME, each optionally @SPEC");
ABSL_FLAG(std::string, rhs, "", "rhs: as --lhs");
ABSL_FLAG(std::string, bias, "", "bias [G,N]: as --lhs");
ABSL_FLAG(std::string, group_sizes, "",
          "gemm: comma-separated sizes (e.g. 3,5,0,8@(fsdp,)); plan: a count (e.g. 8@(ep,))");
ABSL_FLAG(int, groups, 4, "groups for random group sizes when --group-sizes is not given");
ABSL_FLAG(std::string, dtype, "f32", "dtype of generated tensors: f32, bf16, f16");
ABSL_FLAG(std::string, out_dtype, "", "output dtype (default: the lhs dtype)");
ABSL_FLAG(std::string, out_spec, "", "requested output spec");
ABSL_FLAG(bool, rhs_transposed, false, "rhs is [G,N,K]");
ABSL_FLAG(bool, wgrad, false, "ragged-K grouped GEMM (wgrad): rhs is [M,N], out [G,K,N]");
ABSL_FLAG(std::string, compat, "default", "default | te (Transformer Engine's exact rules)");
ABSL_FLAG(uint64_t, seed, 1, "seed for generated tensors and group sizes");
ABSL_FLAG(bool, check, false, "check the result against a local reference");
ABSL_FLAG(std::string, out, "", "write the result to this .npy file");
ABSL_FLAG(std::string, keep_as, "", "keep the output resident under this name");
ABSL_FLAG(std::string, path, "inline",
          "gemm, put, get: inline (the bytes in the request and the response, or a put's and a get's chunks) | "
          "direct (stage each worker its blocks and fetch the blocks from the workers, in parallel; the "
          "coordinator touches none of their bytes)");
ABSL_FLAG(absl::Duration, direct_timeout, absl::Minutes(5),
          "the bound on a gemm's or quantize's whole call (inline on gRPC or --call_socket), and on a gemm's, "
          "put's or get's whole transfer with --path=direct (plan, stage, submit, fetch), e.g. 30s");
ABSL_FLAG(std::string, request, "", "read the GroupedGemmRequest from this JSON file (protobuf JSON mapping)");
ABSL_FLAG(bool, json, false, "print the plan as JSON (protobuf JSON mapping)");
ABSL_FLAG(bool, show_plan, true, "print the plan before the result");
ABSL_FLAG(std::string, data, "", "put: FILE.npy or SHAPE (random)");
ABSL_FLAG(std::string, x, "", "quantize: x as FILE.npy or SHAPE (random), optionally @SPEC");
ABSL_FLAG(std::string, format, "e4m3", "quantize: e4m3 or e5m2");
ABSL_FLAG(bool, shared_scales, false, "quantize: one scale per group across the shards that split its rows");
ABSL_FLAG(std::string, scaling, "current", "quantize: current | delayed | mxfp8 | block (1x128) | block128x128");
ABSL_FLAG(std::string, scales, "", "quantize --scaling=delayed: one scale per --group-sizes entry, comma-separated");
ABSL_FLAG(bool, colwise, false, "quantize: colwise output too");
ABSL_FLAG(bool, colwise_only, false, "quantize: colwise output only");
ABSL_FLAG(std::string, spec, "", "put: partition spec");
ABSL_FLAG(bool, overwrite, false, "put, gemm --keep_as, quantize --keep_*: replace an existing resident tensor");
ABSL_FLAG(std::string, lhs_scale_inv, "", "gemm: FP8 lhs's scales (as --lhs; layouts per --scaling, see the proto)");
ABSL_FLAG(std::string, rhs_scale_inv, "", "gemm: FP8 rhs's scales (as --lhs)");
ABSL_FLAG(std::string, quantize_lhs, "",
          "gemm: quantize a float lhs on the workers to e4m3 or e5m2, then the FP8 GEMM (rhs FP8 with "
          "--rhs_scale_inv; --scaling current or block)");
ABSL_FLAG(std::string, keep_data_as, "", "quantize: keep the rowwise data resident under this name");
ABSL_FLAG(std::string, keep_scale_as, "", "quantize: keep its scales resident (the GEMM's layout) under this name");
ABSL_FLAG(int, flatten_axis, 0, "quantize: dims before it are rows (0: all but the last)");

namespace shardgemm {
namespace {

// For --coordinator: TLS or, on its Unix socket, local credentials.
ClientCredentials CoordinatorCredentials() {
  return ClientCredentialsFromFlags("shardgemm", absl::GetFlag(FLAGS_coordinator));
}

int Fail(const absl::Status& s) {
  std::cerr << "shardgemm: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  return 1;
}

// How a command's tensor bytes travel (--path).
enum class Path { kInline, kDirect };
absl::StatusOr<Path> PathFromFlags() {
  const std::string path = absl::GetFlag(FLAGS_path);
  if (path == "inline") return Path::kInline;
  if (path == "direct") return Path::kDirect;
  return absl::InvalidArgumentError(absl::StrCat("--path: inline or direct, not '", path, "'"));
}

// "SHAPE@SPEC" -> (SHAPE, SPEC); the spec may itself contain '@'-free text.
std::pair<std::string, std::string> SplitSpec(const std::string& text) {
  size_t at = text.find('@');
  if (at == std::string::npos) return {text, ""};
  return {text.substr(0, at), text.substr(at + 1)};
}

absl::StatusOr<std::vector<int64_t>> ParseShape(absl::string_view text, absl::string_view what) {
  std::vector<int64_t> shape;
  for (absl::string_view part : absl::StrSplit(text, 'x')) {
    int64_t d;
    if (!absl::SimpleAtoi(part, &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": bad shape '", text, "'"));
    }
    shape.push_back(d);
  }
  return shape;
}

absl::StatusOr<DType> FlagDType(const std::string& name, absl::string_view flag) {
  auto d = DTypeFromName(name);
  if (!d.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": unknown dtype '", name, "'"));
  }
  return *d;
}

HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint64_t seed) {
  HostTensor t = *ZerosTensor(dtype, std::move(shape));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < t.NumElements(); ++i) StoreFromFloat(&t, i, dist(rng));
  return t;
}

// Fills a v1::Tensor from an operand flag; `host` receives the data when it
// is inline (for the reference check).
absl::Status OperandFromFlag(const std::string& value, absl::string_view what, DType dtype,
                             uint64_t seed, v1::Tensor* out, HostTensor* host) {
  auto [source, spec] = SplitSpec(value);
  out->set_spec(spec);
  if (absl::StartsWith(source, "resident:")) {
    out->set_resident(source.substr(9));
    return absl::OkStatus();
  }
  absl::StatusOr<HostTensor> t;
  if (absl::EndsWith(source, ".npy")) {
    t = ReadNpyFile(source);
  } else {
    auto shape = ParseShape(source, what);
    if (!shape.ok()) return shape.status();
    t = RandomTensor(dtype, *shape, seed);
  }
  if (!t.ok()) return t.status();
  HostTensorToProto(*t, out);
  out->set_spec(spec);
  *host = std::move(*t);
  return absl::OkStatus();
}

// The FP8 GEMM's flags: the operands' scales (a file, or resident:NAME,
// each optionally @SPEC), --scaling and the fused --quantize_lhs.
absl::Status SetFp8GemmFlags(uint64_t seed, v1::GroupedGemmRequest* request) {
  HostTensor unused;
  const std::tuple<std::string, v1::Tensor*, const char*> scales[] = {
      {absl::GetFlag(FLAGS_lhs_scale_inv), request->mutable_lhs_scale_inv(), "--lhs_scale_inv"},
      {absl::GetFlag(FLAGS_rhs_scale_inv), request->mutable_rhs_scale_inv(), "--rhs_scale_inv"}};
  for (const auto& [flag, field, name] : scales) {
    if (flag.empty()) continue;
    if (!absl::StartsWith(flag, "resident:") && !absl::EndsWith(SplitSpec(flag).first, ".npy")) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": a FILE.npy or resident:NAME (scales are not random)"));
    }
    if (auto s = OperandFromFlag(flag, name, DType::kF32, seed, field, &unused); !s.ok()) return s;
  }
  if (!IsGiven(request->lhs_scale_inv())) request->clear_lhs_scale_inv();
  if (!IsGiven(request->rhs_scale_inv())) request->clear_rhs_scale_inv();
  const std::string scaling = absl::GetFlag(FLAGS_scaling);
  if (scaling == "current") {
    request->set_scaling(v1::CURRENT);
  } else if (scaling == "delayed") {
    request->set_scaling(v1::DELAYED);
  } else if (scaling == "mxfp8") {
    request->set_scaling(v1::MXFP8);
  } else if (scaling == "block") {
    request->set_scaling(v1::BLOCK_FP8);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--scaling: for a GEMM, current, delayed, mxfp8 or block, not '", scaling, "'"));
  }
  const std::string q = absl::GetFlag(FLAGS_quantize_lhs);
  if (!q.empty()) {
    if (q != "e4m3" && q != "e5m2") return absl::InvalidArgumentError("--quantize_lhs: e4m3 or e5m2");
    request->mutable_quantize_lhs()->set_dtype(q == "e4m3" ? v1::F8E4M3 : v1::F8E5M2);
  }
  return absl::OkStatus();
}

// Uneven group sizes summing to at most `m`, some possibly empty, plus a few
// padding rows when there is room.
std::vector<int64_t> RandomGroupSizes(int64_t m, int groups, uint64_t seed) {
  std::mt19937_64 rng(seed * 7919 + 13);
  std::vector<double> w(groups);
  for (double& x : w) x = std::uniform_real_distribution<double>(0, 1)(rng);
  if (groups > 2) w[1] = 0;  // one empty group
  double total = 0;
  for (double x : w) total += x;
  const int64_t usable = m - m / 16;
  std::vector<int64_t> sizes(groups, 0);
  int64_t used = 0;
  for (int g = 0; g < groups; ++g) {
    sizes[g] = total > 0 ? static_cast<int64_t>(usable * w[g] / total) : 0;
    used += sizes[g];
  }
  if (groups > 0 && used < usable) sizes[0] += usable - used;
  return sizes;
}

void PrintPlan(const v1::Plan& plan) {
  if (absl::GetFlag(FLAGS_json)) {
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(plan, &json, options);
    std::cout << json << "\n";
  } else {
    std::cout << plan.text();
    if (!plan.text().empty() && plan.text().back() != '\n') std::cout << "\n";
  }
}

v1::Compat CompatFlag() {
  return absl::GetFlag(FLAGS_compat) == "te" ? v1::COMPAT_TE : v1::COMPAT_DEFAULT;
}

int Cluster() {
  ShardGemmClient client(absl::GetFlag(FLAGS_coordinator), CoordinatorCredentials(),
                         ClientMaxMessageBytesFromFlags("shardgemm"));
  client.set_request_id(absl::GetFlag(FLAGS_request_id));
  auto info = client.ClusterInfo();
  if (!info.ok()) return Fail(info.status());
  std::vector<std::string> axes;
  for (const auto& a : info->mesh().axes()) axes.push_back(absl::StrCat(a.name(), "=", a.size()));
  std::cout << "mesh: " << absl::StrJoin(axes, ",") << "  roles: dp=" << info->mesh().roles().dp()
            << " fsdp=" << info->mesh().roles().fsdp() << " ep=" << info->mesh().roles().ep()
            << " tp=" << info->mesh().roles().tp() << "\n"
            << "workers: " << info->workers_size() << " of " << info->workers_expected()
            << (info->ready() ? " (ready)" : " (waiting)") << "\n";
  for (const auto& w : info->workers()) {
    const char* hop = w.hop() != v1::WORKER_HOP_UNIX_SOCKET ? ""
                      : w.step_socket()                     ? "  (called on its Unix socket, steps on its step socket)"
                                                            : "  (called on its Unix socket)";
    std::cout << absl::StrFormat("  rank %d  coords (%s)  %s%s  backend %s  %s%s%s\n", w.rank(),
                                 absl::StrJoin(w.coords(), ","), w.address(), hop, w.backend(), w.device(),
                                 w.staging_address().empty() ? "" : absl::StrCat("  staging ", w.staging_address()),
                                 w.down() ? absl::StrCat("  DOWN: ", w.down_reason()) : "");
  }
  return 0;
}

int PlanCommand() {
  v1::GroupedGemmRequest gemm;
  gemm.set_ragged(absl::GetFlag(FLAGS_wgrad) ? v1::GroupedGemmRequest::RAGGED_K
                                             : v1::GroupedGemmRequest::RAGGED_M);
  gemm.set_rhs_transposed(absl::GetFlag(FLAGS_rhs_transposed));
  gemm.set_compat(CompatFlag());
  gemm.set_out_spec(absl::GetFlag(FLAGS_out_spec));
  auto dtype = FlagDType(absl::GetFlag(FLAGS_dtype), "dtype");
  if (!dtype.ok()) return Fail(dtype.status());
  auto describe = [&](const std::string& value, const char* what, DType d, v1::Tensor* t) {
    auto [shape_text, spec] = SplitSpec(value);
    if (absl::StartsWith(shape_text, "resident:")) {
      t->set_resident(shape_text.substr(9));
      return absl::OkStatus();
    }
    auto shape = ParseShape(shape_text, what);
    if (!shape.ok()) return shape.status();
    t->set_dtype(DTypeToProto(d));
    t->mutable_shape()->Assign(shape->begin(), shape->end());
    t->set_spec(spec);
    return absl::OkStatus();
  };
  for (auto [flag, what, t, d] :
       {std::make_tuple(absl::GetFlag(FLAGS_lhs), "--lhs", gemm.mutable_lhs(), *dtype),
        std::make_tuple(absl::GetFlag(FLAGS_rhs), "--rhs", gemm.mutable_rhs(), *dtype),
        std::make_tuple(absl::GetFlag(FLAGS_group_sizes), "--group-sizes",
                        gemm.mutable_group_sizes(), DType::kI32),
        std::make_tuple(absl::GetFlag(FLAGS_bias), "--bias", gemm.mutable_bias(), *dtype)}) {
    if (flag.empty()) {
      if (std::string(what) == "--bias") continue;
      return Fail(absl::InvalidArgumentError(absl::StrCat(what, " is required")));
    }
    if (auto s = describe(flag, what, d, t); !s.ok()) return Fail(s);
  }
  if (absl::GetFlag(FLAGS_bias).empty()) gemm.clear_bias();
  v1::PlanRequest request;
  *request.mutable_grouped_gemm() = gemm;
  if (!absl::GetFlag(FLAGS_mesh).empty()) {
    auto mesh = planner::ParseMesh(absl::GetFlag(FLAGS_mesh), absl::GetFlag(FLAGS_roles));
    if (!mesh.ok()) return Fail(mesh.status());
    auto resolve = [](const v1::Tensor& t, const std::string& field) -> absl::StatusOr<TensorMeta> {
      auto d = DTypeFromProto(t.dtype(), field);
      if (!d.ok()) return d.status();
      TensorMeta meta{*d, std::vector<int64_t>(t.shape().begin(), t.shape().end()), t.spec(), ""};
      return meta;
    };
    auto pr = GemmPlanRequest(gemm, *mesh, resolve);
    if (!pr.ok()) return Fail(pr.status());
    auto plan = planner::MakePlan(*pr);
    if (!plan.ok()) return Fail(plan.status());
    v1::Plan proto;
    PlanToProto(*plan, &proto);
    PrintPlan(proto);
    return 0;
  }
  ShardGemmClient client(absl::GetFlag(FLAGS_coordinator), CoordinatorCredentials(),
                         ClientMaxMessageBytesFromFlags("shardgemm"));
  client.set_request_id(absl::GetFlag(FLAGS_request_id));
  auto plan = client.Plan(request);
  if (!plan.ok()) return Fail(plan.status());
  PrintPlan(*plan);
  return 0;
}

int Gemm() {
  v1::GroupedGemmRequest request;
  GemmOperands ops;
  if (!absl::GetFlag(FLAGS_request).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_request));
    if (!in) return Fail(absl::NotFoundError("cannot open --request file"));
    std::stringstream ss;
    ss << in.rdbuf();
    auto s = google::protobuf::util::JsonStringToMessage(ss.str(), &request);
    if (!s.ok()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("--request: ", s.ToString())));
    }
    for (auto [t, h] : {std::make_pair(&request.lhs(), &ops.lhs),
                        std::make_pair(&request.rhs(), &ops.rhs)}) {
      if (t->source_case() == v1::Tensor::kData) {
        auto decoded = HostTensorFromProto(*t, "tensor");
        if (!decoded.ok()) return Fail(decoded.status());
        *h = std::move(*decoded);
      }
    }
    if (HasBias(request) && request.bias().source_case() == v1::Tensor::kData) {
      auto decoded = HostTensorFromProto(request.bias(), "bias");
      if (!decoded.ok()) return Fail(decoded.status());
      ops.bias = std::move(*decoded);
    }
    auto gs = HostTensorFromProto(request.group_sizes(), "group_sizes");
    if (gs.ok()) {
      auto v = ToInt64Vector(*gs, "group_sizes");
      if (v.ok()) ops.group_sizes = *v;
    }
  } else {
    auto dtype = FlagDType(absl::GetFlag(FLAGS_dtype), "dtype");
    if (!dtype.ok()) return Fail(dtype.status());
    const uint64_t seed = absl::GetFlag(FLAGS_seed);
    request.set_ragged(absl::GetFlag(FLAGS_wgrad) ? v1::GroupedGemmRequest::RAGGED_K
                                                  : v1::GroupedGemmRequest::RAGGED_M);
    request.set_rhs_transposed(absl::GetFlag(FLAGS_rhs_transposed));
    request.set_compat(CompatFlag());
    request.set_out_spec(absl::GetFlag(FLAGS_out_spec));
    request.set_keep_output_as(absl::GetFlag(FLAGS_keep_as));
    request.set_overwrite_output(absl::GetFlag(FLAGS_overwrite));
    if (absl::GetFlag(FLAGS_lhs).empty() || absl::GetFlag(FLAGS_rhs).empty()) {
      return Fail(absl::InvalidArgumentError("--lhs and --rhs are required"));
    }
    if (auto s = OperandFromFlag(absl::GetFlag(FLAGS_lhs), "--lhs", *dtype, seed,
                                 request.mutable_lhs(), &ops.lhs); !s.ok()) return Fail(s);
    if (auto s = OperandFromFlag(absl::GetFlag(FLAGS_rhs), "--rhs", *dtype, seed + 1,
                                 request.mutable_rhs(), &ops.rhs); !s.ok()) return Fail(s);
    if (!absl::GetFlag(FLAGS_bias).empty()) {
      if (auto s = OperandFromFlag(absl::GetFlag(FLAGS_bias), "--bias", *dtype, seed + 2,
                                   request.mutable_bias(), &ops.bias); !s.ok()) return Fail(s);
    }
    auto [sizes_text, sizes_spec] = SplitSpec(absl::GetFlag(FLAGS_group_sizes));
    if (!sizes_text.empty()) {
      for (absl::string_view part : absl::StrSplit(sizes_text, ',')) {
        int64_t v;
        if (!absl::SimpleAtoi(part, &v)) {
          return Fail(absl::InvalidArgumentError(
              absl::StrCat("--group-sizes: '", part, "' is not an integer")));
        }
        ops.group_sizes.push_back(v);
      }
    } else if (ops.lhs.dtype != DType::kInvalid) {
      if (absl::GetFlag(FLAGS_groups) <= 0 || absl::GetFlag(FLAGS_groups) > 1000000) {
        return Fail(absl::InvalidArgumentError("--groups must be between 1 and 1000000"));
      }
      if (ops.lhs.shape.size() != 2) {
        return Fail(absl::InvalidArgumentError("--lhs must be [M, K] (rank 2)"));
      }
      ops.group_sizes = RandomGroupSizes(ops.lhs.shape.at(0), absl::GetFlag(FLAGS_groups), seed);
    } else {
      return Fail(absl::InvalidArgumentError("--group-sizes is required with a resident lhs"));
    }
    HostTensor gs = *ZerosTensor(DType::kI64, {static_cast<int64_t>(ops.group_sizes.size())});
    std::copy(ops.group_sizes.begin(), ops.group_sizes.end(), gs.data<int64_t>());
    HostTensorToProto(gs, request.mutable_group_sizes());
    request.mutable_group_sizes()->set_spec(sizes_spec);
    if (!absl::GetFlag(FLAGS_out_dtype).empty()) {
      auto od = FlagDType(absl::GetFlag(FLAGS_out_dtype), "out_dtype");
      if (!od.ok()) return Fail(od.status());
      request.set_out_dtype(DTypeToProto(*od));
    }
    if (auto s = SetFp8GemmFlags(seed, &request); !s.ok()) return Fail(s);
  }
  request.set_include_plan(true);
  if (absl::GetFlag(FLAGS_check) && (IsGiven(request.rhs_scale_inv()) || request.has_quantize_lhs())) {
    return Fail(absl::InvalidArgumentError(
        "--check: the CLI's reference is the 16/32-bit GEMM; FP8 GEMMs are checked against the reference in "
        "tests/test_fp8_gemm.py (and kernels/cpu/fp8_grouped_gemm)"));
  }
  ops.ragged_k = request.ragged() == v1::GroupedGemmRequest::RAGGED_K;
  ops.rhs_transposed = request.rhs_transposed();

  auto path = PathFromFlags();
  if (!path.ok()) return Fail(path.status());
  ShardGemmClient client(absl::GetFlag(FLAGS_coordinator), CoordinatorCredentials(),
                         ClientMaxMessageBytesFromFlags("shardgemm"));
  client.set_request_id(absl::GetFlag(FLAGS_request_id));
  client.set_timeout(absl::GetFlag(FLAGS_direct_timeout));
  if (const std::string socket = absl::GetFlag(FLAGS_call_socket); !socket.empty()) client.UseCallSocket(socket);
  const absl::Time start = absl::Now();
  auto response = *path == Path::kDirect ? client.GroupedGemmDirect(request) : client.GroupedGemm(request);
  if (!response.ok()) return Fail(response.status());
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (absl::GetFlag(FLAGS_show_plan)) PrintPlan(response->plan());
  const auto& out = response->out();
  std::cout << "group sizes: " << absl::StrJoin(ops.group_sizes, ",") << "\n";
  std::cout << absl::StrFormat(
      "result: %s %s%s  (%.3f ms round trip, %.3f ms on the server, %.3f ms in the slowest worker; "
      "request id %s)\n",
      ShapeToString(std::vector<int64_t>(out.shape().begin(), out.shape().end())),
      DTypeName(static_cast<DType>(static_cast<int>(out.dtype()))),
      out.resident().empty() ? "" : absl::StrCat(" kept as '", out.resident(), "'"), seconds * 1e3,
      response->server_seconds() * 1e3, response->worker_seconds() * 1e3, client.last_request_id());
  if (!out.resident().empty()) return 0;
  auto result = HostTensorFromProto(out, "out");
  if (!result.ok()) return Fail(result.status());
  if (!absl::GetFlag(FLAGS_out).empty()) {
    if (auto s = WriteNpyFile(absl::GetFlag(FLAGS_out), *result); !s.ok()) return Fail(s);
    std::cout << "wrote " << absl::GetFlag(FLAGS_out) << "\n";
  }
  if (absl::GetFlag(FLAGS_check)) {
    // Resident operands are read back from the workers for the reference.
    for (auto [t, h] : {std::make_pair(&request.lhs(), &ops.lhs), std::make_pair(&request.rhs(), &ops.rhs),
                        std::make_pair(&request.bias(), &ops.bias)}) {
      if (t->source_case() != v1::Tensor::kResident) continue;
      auto fetched = client.GetTensor(t->resident());
      if (!fetched.ok()) return Fail(fetched.status());
      *h = std::move(*fetched);
    }
    if (ops.lhs.shape.size() != 2) {
      return Fail(absl::InvalidArgumentError("--check needs lhs of rank 2"));
    }
    // With the GLOBAL_SORTED layout the result is the unsharded grouped GEMM.
    v1::Plan reference_plan = response->plan();
    if (request.layout() == v1::GroupedGemmRequest::GLOBAL_SORTED) reference_plan.clear_workers();
    auto reference = ReferenceGroupedGemm(ops, reference_plan);
    if (!reference.ok()) return Fail(reference.status());
    const int64_t contracting = ops.ragged_k ? ops.lhs.shape.at(0) : ops.lhs.shape.at(1);
    Comparison c = CompareToReference(*result, *reference, contracting);
    if (!c.ok()) {
      std::cout << absl::StrFormat(
          "result DOES NOT match reference: %d elements off, max error %.3g (tolerance %.3g)\n",
          c.mismatches, c.max_abs_error, c.tolerance);
      return 3;
    }
    std::cout << absl::StrFormat("result matches reference: max error %.3g (tolerance %.3g)\n",
                                 c.max_abs_error, c.tolerance);
  }
  return 0;
}

// Grouped quantize through the service. --check dequantizes every element
// with its scale and bounds the error by FP8 rounding: half an ulp relative
// (2^-4 for E4M3, 2^-3 for E5M2), or half the smallest subnormal times the
// scale near zero, of the value saturated to the format's range (MXFP8's OCP
// scale may clip a block's largest values).
struct FormatBounds {
  Fp8Format fmt;
  double rel, tiny;
};

struct QuantizeCheck {
  int64_t bad = 0;
  double worst = 0;
  void Add(const FormatBounds& f, double want, uint8_t q, double scale_inv) {
    const double clipped = std::copysign(std::min(std::fabs(want), Fp8Max(f.fmt) * scale_inv), want);
    const double err = std::fabs(Fp8ToFloat(q, f.fmt) * scale_inv - clipped);
    const double bound = std::max(f.rel * std::fabs(clipped), f.tiny * scale_inv);
    worst = std::max(worst, err / bound);
    if (!(err <= bound * 1.0001)) ++bad;
  }
};

absl::StatusOr<std::vector<int64_t>> ParseList(const std::string& text, const char* flag) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", part, "' is not an integer"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " is required"));
  return out;
}

// --scaling: current | delayed | mxfp8 | block (1x128) | block128x128.
absl::Status SetScaling(const std::string& scaling, const std::string& scales_text, int64_t groups,
                        v1::GroupedQuantizeRequest* request) {
  if (scaling == "current") request->set_scaling(v1::CURRENT);
  else if (scaling == "mxfp8") request->set_scaling(v1::MXFP8);
  else if (scaling == "block") request->set_scaling(v1::BLOCK_FP8);
  else if (scaling == "block128x128") request->set_scaling(v1::BLOCK_FP8), request->set_block_2d(true);
  else if (scaling != "delayed") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--scaling must be current, delayed, mxfp8, block or block128x128, got '", scaling, "'"));
  }
  if (scaling != "delayed") return absl::OkStatus();
  request->set_scaling(v1::DELAYED);
  HostTensor scales = *ZerosTensor(DType::kF32, {groups});
  std::vector<std::string> parts = absl::StrSplit(scales_text, ',', absl::SkipEmpty());
  if (static_cast<int64_t>(parts.size()) != groups) {
    return absl::InvalidArgumentError(absl::StrCat("--scales: delayed scaling needs one scale per "
                                                   "--group-sizes entry (", groups, ")"));
  }
  for (int64_t i = 0; i < groups; ++i) {
    if (!absl::SimpleAtof(parts[i], &scales.data<float>()[i])) {
      return absl::InvalidArgumentError(absl::StrCat("--scales: '", parts[i], "' is not a number"));
    }
  }
  HostTensorToProto(scales, request->mutable_scales());
  return absl::OkStatus();
}

// Row shards in row order: (first group_sizes entry, first group).
std::vector<RowShard> PlanRowShards(const v1::Plan& plan) {
  std::map<int64_t, RowShard> by_begin;
  for (const v1::WorkerPlan& w : plan.workers()) {
    by_begin.emplace(w.group_sizes_begin(), RowShard{w.group_sizes_begin(), w.first_group()});
  }
  std::vector<RowShard> out;
  for (const auto& [begin, shard] : by_begin) out.push_back(shard);
  return out;
}

// Current / delayed: one scale_inv per group_sizes entry; colwise data is
// per group the transpose [K, m_g] at the group's first row * K.
void CheckPerGroup(const HostTensor& x, const HostTensor& data, bool transposed, const HostTensor& scale_inv,
                   const std::vector<int64_t>& sizes, const v1::Plan& plan, const FormatBounds& f,
                   QuantizeCheck* check) {
  const int64_t local_groups = plan.workers_size() ? plan.workers(0).local_groups()
                                                   : static_cast<int64_t>(sizes.size());
  const int64_t shards = static_cast<int64_t>(sizes.size()) / std::max<int64_t>(local_groups, 1);
  const int64_t cols = x.shape.back(), rows = x.NumElements() / std::max<int64_t>(cols, 1);
  const int64_t shard_rows = rows / std::max<int64_t>(shards, 1);
  for (int64_t s = 0; s < shards; ++s) {
    int64_t row = s * shard_rows;
    for (int64_t j = 0; j < local_groups; ++j) {
      const int64_t entry = s * local_groups + j;
      const int64_t n = sizes[entry];
      for (int64_t i = 0; i < n * cols; ++i) {
        const int64_t at = transposed ? row * cols + (i % cols) * n + i / cols : row * cols + i;
        check->Add(f, LoadAsFloat(x, row * cols + i), static_cast<uint8_t>(data.bytes[at]),
                   scale_inv.data<float>()[entry]);
      }
      row += sizes[entry];
    }
  }
}

// The scale of element (r, c) of group g (r counted within the group) in the
// kernels' padded layout (docs/quantization.md).
double BlockScale(ScalingMode mode, bool colwise, const QuantizeLayout& l, const HostTensor& scales,
                  int64_t g, int64_t r, int64_t c) {
  const int64_t cols = colwise ? l.colwise_scale_cols[g] : l.rowwise_scale_cols[g];
  int64_t i = (colwise ? l.colwise_scale_offset : l.rowwise_scale_offset)[g];
  switch (mode) {
    case ScalingMode::kMxfp8: i += colwise ? (r / 32) * cols + c : r * cols + c / 32; break;
    case ScalingMode::kBlock1x128: i += colwise ? (r / 128) * cols + c : (c / 128) * cols + r; break;
    default: i += colwise ? (c / 128) * cols + r / 128 : (r / 128) * cols + c / 128; break;
  }
  if (mode == ScalingMode::kMxfp8) return E8M0ToFloat(static_cast<uint8_t>(scales.bytes[i]));
  return scales.data<float>()[i];
}

// MXFP8 / block scaling: data follows x's rows, the scales (and block
// scaling's transposed colwise data) are the unsharded op's for
// response.scale_group_sizes, group g holding its rows of every row shard.
absl::Status CheckBlockScaled(const HostTensor& x, const v1::GroupedQuantizeResponse& r,
                              const v1::GroupedQuantizeRequest& request,
                              const std::vector<int64_t>& sizes, const FormatBounds& f,
                              QuantizeCheck* check) {
  auto kernel_mode = KernelScalingMode(request.scaling(), request.block_2d());
  if (!kernel_mode.ok()) return kernel_mode.status();
  const ScalingMode mode = *kernel_mode;
  if (r.plan().workers_size() == 0) return absl::InternalError("the response has no plan");
  const int64_t k = x.shape.back(), m = x.NumElements() / std::max<int64_t>(k, 1);
  const int64_t local_groups = r.plan().workers(0).local_groups();
  const std::vector<RowShard> shards = PlanRowShards(r.plan());
  const std::vector<int64_t> global(r.scale_group_sizes().begin(), r.scale_group_sizes().end());
  auto groups = MakeGlobalGroups(sizes, shards, local_groups, static_cast<int64_t>(global.size()));
  if (!groups.ok()) return groups.status();
  if (groups->sizes != global) return absl::InternalError("scale_group_sizes differ from the plan's groups");
  auto layout = BlockLayout(mode, m, k, true, true, global);
  if (!layout.ok()) return layout.status();
  const int64_t shard_rows = m / static_cast<int64_t>(shards.size());
  for (int dir = 0; dir < 2; ++dir) {
    const bool colwise = dir == 1;
    if (colwise ? !request.colwise() : !(request.rowwise() || !request.colwise())) continue;
    auto data = HostTensorFromProto(colwise ? r.colwise_data() : r.rowwise_data(), "data");
    auto scales = HostTensorFromProto(colwise ? r.colwise_scale_inv() : r.scale_inv(), "scale_inv");
    if (!data.ok() || !scales.ok()) return absl::InternalError("malformed response");
    // Every index below stays inside these sizes when the response is well formed.
    const int64_t want_scales = colwise ? layout->colwise_scale_elems : layout->rowwise_scale_elems;
    if (data->NumElements() != m * k || scales->NumElements() < want_scales) {
      return absl::InternalError(absl::StrCat("malformed response: ", colwise ? "colwise" : "rowwise", " data has ",
                                              data->NumElements(), " elements (want ", m * k, "), scales ",
                                              scales->NumElements(), " (want ", want_scales, ")"));
    }
    const bool transposed = colwise && mode != ScalingMode::kMxfp8;
    for (size_t s = 0; s < shards.size(); ++s) {
      int64_t row = static_cast<int64_t>(s) * shard_rows;
      for (int64_t j = 0; j < local_groups; ++j) {
        const int64_t e = shards[s].sizes_begin + j, g = groups->group[e];
        for (int64_t i = 0; i < sizes[e]; ++i) {
          const int64_t gr = groups->piece_start[e] + i;  // row within group g
          for (int64_t c = 0; c < k; ++c) {
            const int64_t at = transposed ? layout->row_offset[g] * k + c * global[g] + gr : (row + i) * k + c;
            check->Add(f, LoadAsFloat(x, (row + i) * k + c), static_cast<uint8_t>(data->bytes[at]),
                       BlockScale(mode, colwise, *layout, *scales, g, gr, c));
          }
        }
        row += sizes[e];
      }
    }
  }
  return absl::OkStatus();
}

int Quantize() {
  auto dtype = FlagDType(absl::GetFlag(FLAGS_dtype), "dtype");
  if (!dtype.ok()) return Fail(dtype.status());
  v1::GroupedQuantizeRequest request;
  HostTensor x;
  if (absl::GetFlag(FLAGS_x).empty()) return Fail(absl::InvalidArgumentError("--x is required"));
  if (auto s = OperandFromFlag(absl::GetFlag(FLAGS_x), "--x", *dtype, absl::GetFlag(FLAGS_seed),
                               request.mutable_x(), &x); !s.ok()) return Fail(s);
  auto [sizes_text, sizes_spec] = SplitSpec(absl::GetFlag(FLAGS_group_sizes));
  auto sizes = ParseList(sizes_text, "--group-sizes");
  if (!sizes.ok()) return Fail(sizes.status());
  HostTensor gs = *ZerosTensor(DType::kI64, {static_cast<int64_t>(sizes->size())});
  std::copy(sizes->begin(), sizes->end(), gs.data<int64_t>());
  HostTensorToProto(gs, request.mutable_group_sizes());
  request.mutable_group_sizes()->set_spec(sizes_spec);
  const bool e5m2 = absl::GetFlag(FLAGS_format) == "e5m2";
  if (!e5m2 && absl::GetFlag(FLAGS_format) != "e4m3") {
    return Fail(absl::InvalidArgumentError("--format must be e4m3 or e5m2"));
  }
  request.set_out_dtype(e5m2 ? v1::F8E5M2 : v1::F8E4M3);
  if (auto s = SetScaling(absl::GetFlag(FLAGS_scaling), absl::GetFlag(FLAGS_scales),
                          static_cast<int64_t>(sizes->size()), &request);
      !s.ok()) {
    return Fail(s);
  }
  request.set_rowwise(!absl::GetFlag(FLAGS_colwise_only));
  request.set_colwise(absl::GetFlag(FLAGS_colwise) || absl::GetFlag(FLAGS_colwise_only));
  request.set_shared_scales(absl::GetFlag(FLAGS_shared_scales));
  request.set_compat(CompatFlag());
  request.set_include_plan(true);
  request.set_flatten_axis(absl::GetFlag(FLAGS_flatten_axis));
  request.mutable_keep()->set_rowwise_data(absl::GetFlag(FLAGS_keep_data_as));
  request.mutable_keep()->set_scale_inv(absl::GetFlag(FLAGS_keep_scale_as));
  request.mutable_keep()->set_overwrite(absl::GetFlag(FLAGS_overwrite));
  const bool keeping = !absl::GetFlag(FLAGS_keep_data_as).empty() || !absl::GetFlag(FLAGS_keep_scale_as).empty();
  if (keeping && absl::GetFlag(FLAGS_check)) {
    return Fail(absl::InvalidArgumentError("--check reads the returned outputs: drop --keep_data_as/--keep_scale_as"));
  }
  ShardGemmClient client(absl::GetFlag(FLAGS_coordinator), CoordinatorCredentials(),
                         ClientMaxMessageBytesFromFlags("shardgemm"));
  client.set_request_id(absl::GetFlag(FLAGS_request_id));
  client.set_timeout(absl::GetFlag(FLAGS_direct_timeout));
  if (const std::string socket = absl::GetFlag(FLAGS_call_socket); !socket.empty()) client.UseCallSocket(socket);
  auto r = client.GroupedQuantize(request);
  if (!r.ok()) return Fail(r.status());
  if (keeping) {
    if (absl::GetFlag(FLAGS_show_plan)) PrintPlan(r->plan());
    for (const v1::Tensor* t : {&r->rowwise_data(), &r->scale_inv()}) {
      if (t->resident().empty()) continue;
      std::cout << "kept '" << t->resident() << "': "
                << ShapeToString(std::vector<int64_t>(t->shape().begin(), t->shape().end())) << " "
                << DTypeName(static_cast<DType>(static_cast<int>(t->dtype()))) << " @" << t->spec() << "\n";
    }
    return 0;
  }
  if (absl::GetFlag(FLAGS_show_plan)) PrintPlan(r->plan());
  const bool block = request.scaling() == v1::MXFP8 || request.scaling() == v1::BLOCK_FP8;
  const v1::Tensor& first = request.rowwise() ? r->rowwise_data() : r->colwise_data();
  std::cout << "quantized " << ShapeToString(std::vector<int64_t>(first.shape().begin(), first.shape().end()))
            << " to " << absl::GetFlag(FLAGS_format) << " (" << absl::GetFlag(FLAGS_scaling) << ")";
  if (block) {
    std::cout << "; scales for groups of " << absl::StrJoin(r->scale_group_sizes(), ",") << " rows\n";
  } else {
    auto amax = HostTensorFromProto(r->amax(), "amax");
    if (!amax.ok()) return Fail(absl::InternalError("malformed response"));
    std::cout << "; amax per group entry: ";
    for (int64_t i = 0; i < amax->NumElements(); ++i) std::cout << (i ? "," : "") << amax->data<float>()[i];
    std::cout << "\n";
  }
  if (!absl::GetFlag(FLAGS_check)) return 0;
  const FormatBounds f = e5m2 ? FormatBounds{Fp8Format::kE5M2, 0.125, std::ldexp(1.0, -17)}
                              : FormatBounds{Fp8Format::kE4M3, 0.0625, std::ldexp(1.0, -10)};
  QuantizeCheck check;
  if (block) {
    if (auto s = CheckBlockScaled(x, *r, request, *sizes, f, &check); !s.ok()) return Fail(s);
  } else {
    auto data = HostTensorFromProto(first, "data");
    auto scale_inv = HostTensorFromProto(r->scale_inv(), "scale_inv");
    if (!data.ok() || !scale_inv.ok()) return Fail(absl::InternalError("malformed response"));
    int64_t rows_in_groups = 0;
    for (int64_t n : *sizes) rows_in_groups += n;
    if (data->NumElements() != x.NumElements() || scale_inv->dtype != DType::kF32 ||
        scale_inv->NumElements() < static_cast<int64_t>(sizes->size()) ||
        rows_in_groups * x.shape.back() > x.NumElements()) {
      return Fail(absl::InternalError("malformed response: data or scale_inv do not match x and group_sizes"));
    }
    CheckPerGroup(x, *data, !request.rowwise(), *scale_inv, *sizes, r->plan(), f, &check);
  }
  if (check.bad) {
    std::cout << "result DOES NOT match reference: " << check.bad << " elements off\n";
    return 3;
  }
  std::cout << absl::StrFormat(
      "result matches reference: dequantized within FP8 rounding (worst error %.3g of its bound: "
      "%.3g relative, or half the smallest subnormal times the scale, of the value saturated to "
      "the block's range)\n", check.worst, f.rel);
  return 0;
}

int Put(const std::string& name) {
  auto dtype = FlagDType(absl::GetFlag(FLAGS_dtype), "dtype");
  if (!dtype.ok()) return Fail(dtype.status());
  const std::string data = absl::GetFlag(FLAGS_data);
  absl::StatusOr<HostTensor> t;
  if (absl::EndsWith(data, ".npy")) {
    t = ReadNpyFile(data);
  } else {
    auto shape = ParseShape(data, "--data");
    if (!shape.ok()) return Fail(shape.status());
    t = RandomTensor(*dtype, *shape, absl::GetFlag(FLAGS_seed));
  }
  if (!t.ok()) return Fail(t.status());
  auto path = PathFromFlags();
  if (!path.ok()) return Fail(path.status());
  ShardGemmClient client(absl::GetFlag(FLAGS_coordinator), CoordinatorCredentials(),
                         ClientMaxMessageBytesFromFlags("shardgemm"));
  client.set_request_id(absl::GetFlag(FLAGS_request_id));
  client.set_timeout(absl::GetFlag(FLAGS_direct_timeout));
  const absl::Time start = absl::Now();
  auto r = *path == Path::kDirect
               ? client.PutTensorDirect(name, *t, absl::GetFlag(FLAGS_spec), absl::GetFlag(FLAGS_overwrite))
               : client.PutTensor(name, *t, absl::GetFlag(FLAGS_spec), absl::GetFlag(FLAGS_overwrite));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!r.ok()) return Fail(r.status());
  std::cout << "put '" << r->name() << "': " << ShapeToString(t->shape) << " "
            << DTypeName(t->dtype) << ", " << r->bytes() << " bytes, spec "
            << (absl::GetFlag(FLAGS_spec).empty() ? "()" : absl::GetFlag(FLAGS_spec))
            << absl::StrFormat("  (%.1f ms, %.2f GB/s)", seconds * 1e3, r->bytes() / seconds / 1e9) << "\n";
  return 0;
}

int Get(const std::string& name) {
  auto path = PathFromFlags();
  if (!path.ok()) return Fail(path.status());
  ShardGemmClient client(absl::GetFlag(FLAGS_coordinator), CoordinatorCredentials(),
                         ClientMaxMessageBytesFromFlags("shardgemm"));
  client.set_request_id(absl::GetFlag(FLAGS_request_id));
  client.set_timeout(absl::GetFlag(FLAGS_direct_timeout));
  const absl::Time start = absl::Now();
  auto t = *path == Path::kDirect ? client.GetTensorDirect(name) : client.GetTensor(name);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!t.ok()) return Fail(t.status());
  std::cout << "got '" << name << "': " << ShapeToString(t->shape) << " " << DTypeName(t->dtype)
            << absl::StrFormat("  (%d bytes, %.1f ms, %.2f GB/s)", t->NumBytes(), seconds * 1e3,
                               t->NumBytes() / seconds / 1e9)
            << "\n";
  if (!absl::GetFlag(FLAGS_out).empty()) {
    if (auto s = WriteNpyFile(absl::GetFlag(FLAGS_out), *t); !s.ok()) return Fail(s);
    std::cout << "wrote " << absl::GetFlag(FLAGS_out) << "\n";
  }
  return 0;
}

int List() {
  ShardGemmClient client(absl::GetFlag(FLAGS_coordinator), CoordinatorCredentials(),
                         ClientMaxMessageBytesFromFlags("shardgemm"));
  client.set_request_id(absl::GetFlag(FLAGS_request_id));
  auto r = client.ListTensors();
  if (!r.ok()) return Fail(r.status());
  for (const auto& t : r->tensors()) {
    std::cout << t.name() << "  " << absl::StrJoin(t.shape(), "x") << " "
              << DTypeName(static_cast<DType>(static_cast<int>(t.dtype()))) << "  " << t.spec()
              << (t.replicas() > 1 ? absl::StrCat("  ", t.replicas(), " copies") : "")
              << (t.restoring() ? "  RESTORING" : "") << (t.lost() ? "  LOST: " + t.lost_reason() : "") << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace shardgemm

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "shardgemm COMMAND [flags]\n"
      "commands: cluster | plan | gemm | quantize | put NAME | get NAME | delete NAME | ls\n"
      "see README.md or --helpfull");
  // Accept --group-sizes as well as --group_sizes.
  std::vector<std::string> normalized(argv, argv + argc);
  for (std::string& a : normalized) {
    if (a.rfind("--", 0) != 0) continue;
    for (size_t i = 2; i < a.size() && a[i] != '='; ++i) {
      if (a[i] == '-') a[i] = '_';
    }
  }
  std::vector<char*> raw;
  for (std::string& a : normalized) raw.push_back(&a[0]);
  std::vector<char*> args = absl::ParseCommandLine(argc, raw.data());
  using namespace shardgemm;
  if (args.size() < 2) {
    std::cerr << "usage: shardgemm cluster|plan|gemm|quantize|put|get|delete|ls [flags] (--help)\n";
    return 2;
  }
  const std::string command = args[1];
  const std::string name = args.size() > 2 ? args[2] : "";
  if (command == "cluster") return Cluster();
  if (command == "plan") return PlanCommand();
  if (command == "gemm") return Gemm();
  if (command == "quantize") return Quantize();
  if ((command == "put" || command == "get" || command == "delete") && name.empty()) {
    std::cerr << "shardgemm " << command << ": missing tensor NAME\n";
    return 2;
  }
  if (command == "put") return Put(name);
  if (command == "get") return Get(name);
  if (command == "delete") {
    ShardGemmClient client(absl::GetFlag(FLAGS_coordinator), CoordinatorCredentials(),
                         ClientMaxMessageBytesFromFlags("shardgemm"));
  client.set_request_id(absl::GetFlag(FLAGS_request_id));
    absl::Status s = client.DeleteTensor(name);
    if (!s.ok()) return Fail(s);
    std::cout << "deleted '" << name << "'\n";
    return 0;
  }
  if (command == "ls") return List();
  std::cerr << "shardgemm: unknown command '" << command << "'\n";
  return 2;
}
