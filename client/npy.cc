#include "client/npy.h"

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardgemm {
namespace {

// Value of `key` in the header dict, e.g. 'descr': '<f4' -> <f4 (raw text up
// to the next top-level comma or closing brace for tuples).
absl::StatusOr<std::string> HeaderValue(absl::string_view header, absl::string_view key) {
  std::string quoted = absl::StrCat("'", key, "'");
  size_t pos = header.find(quoted);
  if (pos == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("npy header has no ", quoted));
  }
  pos = header.find(':', pos + quoted.size());
  if (pos == absl::string_view::npos) return absl::InvalidArgumentError("malformed npy header");
  absl::string_view rest = absl::StripLeadingAsciiWhitespace(header.substr(pos + 1));
  if (!rest.empty() && rest[0] == '(') {
    size_t end = rest.find(')');
    if (end == absl::string_view::npos) return absl::InvalidArgumentError("malformed npy shape");
    return std::string(rest.substr(1, end - 1));
  }
  if (!rest.empty() && (rest[0] == '\'' || rest[0] == '"')) {
    size_t end = rest.find(rest[0], 1);
    if (end == absl::string_view::npos) return absl::InvalidArgumentError("malformed npy descr");
    return std::string(rest.substr(1, end - 1));
  }
  size_t end = rest.find_first_of(",}");
  return std::string(absl::StripAsciiWhitespace(rest.substr(0, end)));
}

absl::StatusOr<DType> DTypeFromDescr(absl::string_view descr, absl::optional<DType> raw_dtype) {
  if (descr == "<f4") return DType::kF32;
  if (descr == "<f2") return DType::kF16;
  if (descr == "<i4") return DType::kI32;
  if (descr == "<i8") return DType::kI64;
  if (descr == "<V2" || descr == "|V2") {
    DType d = raw_dtype.value_or(DType::kBF16);
    if (DTypeSize(d) == 2) return d;
  }
  if (descr == "<V1" || descr == "|V1" || descr == "|u1") {
    DType d = raw_dtype.value_or(DType::kF8E4M3);
    if (DTypeSize(d) == 1) return d;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "npy dtype '", descr, "' is not supported (float32, float16, bfloat16, float8, int32, int64)"));
}

std::string DescrFor(DType d) {
  switch (d) {
    case DType::kF32: return "<f4";
    case DType::kF16: return "<f2";
    case DType::kI32: return "<i4";
    case DType::kI64: return "<i8";
    case DType::kBF16: return "<V2";
    default: return "|V1";
  }
}

}  // namespace

absl::StatusOr<HostTensor> ParseNpy(absl::string_view contents, absl::optional<DType> raw_dtype) {
  if (contents.size() < 10 || contents.substr(0, 6) != "\x93NUMPY") {
    return absl::InvalidArgumentError("not an .npy file (bad magic)");
  }
  const int major = static_cast<unsigned char>(contents[6]);
  size_t header_len, offset;
  if (major == 1) {
    header_len = static_cast<unsigned char>(contents[8]) |
                 static_cast<size_t>(static_cast<unsigned char>(contents[9])) << 8;
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (contents.size() < 12) return absl::InvalidArgumentError("truncated .npy header");
    header_len = 0;
    for (int i = 3; i >= 0; --i) header_len = header_len << 8 | static_cast<unsigned char>(contents[8 + i]);
    offset = 12;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unsupported .npy version ", major));
  }
  if (offset + header_len > contents.size()) return absl::InvalidArgumentError("truncated .npy header");
  absl::string_view header = contents.substr(offset, header_len);
  auto descr = HeaderValue(header, "descr");
  if (!descr.ok()) return descr.status();
  auto fortran = HeaderValue(header, "fortran_order");
  if (!fortran.ok()) return fortran.status();
  if (*fortran != "False") return absl::InvalidArgumentError("Fortran-order .npy is not supported");
  auto shape_text = HeaderValue(header, "shape");
  if (!shape_text.ok()) return shape_text.status();
  auto dtype = DTypeFromDescr(*descr, raw_dtype);
  if (!dtype.ok()) return dtype.status();
  HostTensor t;
  t.dtype = *dtype;
  for (absl::string_view part : absl::StrSplit(*shape_text, ',', absl::SkipWhitespace())) {
    int64_t d;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad .npy shape '", *shape_text, "'"));
    }
    t.shape.push_back(d);
  }
  auto n = CheckedNumElements(t.shape, DTypeSize(t.dtype), "npy");
  if (!n.ok()) return n.status();
  absl::string_view data = contents.substr(offset + header_len);
  const uint64_t expected = static_cast<uint64_t>(*n) * DTypeSize(t.dtype);
  if (data.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(".npy data has ", data.size(), " bytes, shape needs ", expected));
  }
  t.bytes.assign(data.data(), data.size());
  return t;
}

std::string SerializeNpy(const HostTensor& t) {
  std::string shape;
  for (int64_t d : t.shape) absl::StrAppend(&shape, d, ",");
  if (t.shape.size() > 1) shape.pop_back();
  std::string header = absl::StrCat("{'descr': '", DescrFor(t.dtype),
                                    "', 'fortran_order': False, 'shape': (", shape, "), }");
  // Pad so data starts on a 64-byte boundary; the header ends with '\n'.
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  out += t.bytes;
  return out;
}

absl::StatusOr<HostTensor> ReadNpyFile(const std::string& path, absl::optional<DType> raw_dtype) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  // Read once into a buffer of the file's size (a stringstream held the file twice more).
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::InternalError(absl::StrCat("cannot size ", path));
  std::string contents(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(contents.data(), size)) return absl::InternalError(absl::StrCat("short read of ", path));
  auto t = ParseNpy(contents, raw_dtype);
  if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", t.status().message()));
  return t;
}

absl::Status WriteNpyFile(const std::string& path, const HostTensor& t) {
  std::ofstream out(path, std::ios::binary);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  std::string s = SerializeNpy(t);
  out.write(s.data(), static_cast<std::streamsize>(s.size()));
  if (!out) return absl::InternalError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace shardgemm
