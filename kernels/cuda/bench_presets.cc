#include "kernels/cuda/bench_presets.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace shardgemm {
namespace cuda {

absl::StatusOr<std::vector<Preset>> LoadPresets(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read presets file ", path));
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("presets") || !doc["presets"].is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not JSON with a \"presets\" array"));
  }
  std::vector<Preset> presets;
  for (const nlohmann::json& p : doc["presets"]) {
    const std::string at = absl::StrCat(path, ": preset ", presets.size());
    if (!p.is_object() || !p.contains("name") || !p["name"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(at, ": needs a string \"name\""));
    }
    Preset preset;
    preset.name = p["name"].get<std::string>();
    for (auto [field, value] : {std::pair<const char*, int64_t*>{"groups", &preset.g},
                                {"rows_per_group", &preset.m},
                                {"k", &preset.k},
                                {"n", &preset.n}}) {
      if (!p.contains(field) || !p[field].is_number_integer() || p[field].get<int64_t>() <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(at, " (", preset.name, "): \"", field, "\" must be a positive integer"));
      }
      *value = p[field].get<int64_t>();
    }
    presets.push_back(std::move(preset));
  }
  return presets;
}

}  // namespace cuda
}  // namespace shardgemm
