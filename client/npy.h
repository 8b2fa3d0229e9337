// NumPy .npy files (format 1.0-3.0, C order, little-endian), the way ML users
// already exchange arrays. bfloat16 and float8 arrays saved through ml_dtypes
// carry the raw descr '<V2' / '<V1': they read as BF16 / F8E4M3 unless the
// caller names the dtype.
#ifndef SHARDGEMM_CLIENT_NPY_H_
#define SHARDGEMM_CLIENT_NPY_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/types/optional.h"
#include "kernels/host_tensor.h"

namespace shardgemm {

absl::StatusOr<HostTensor> ParseNpy(absl::string_view contents,
                                    absl::optional<DType> raw_dtype = absl::nullopt);
std::string SerializeNpy(const HostTensor& t);

absl::StatusOr<HostTensor> ReadNpyFile(const std::string& path,
                                       absl::optional<DType> raw_dtype = absl::nullopt);
absl::Status WriteNpyFile(const std::string& path, const HostTensor& t);

}  // namespace shardgemm

#endif  // SHARDGEMM_CLIENT_NPY_H_
