#include "kernels/fp8.h"

namespace shardgemm {

const char* Fp8FormatName(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

}  // namespace shardgemm
