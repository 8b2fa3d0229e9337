#include "kernels/cuda/bench_presets.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace shardgemm {
namespace cuda {
namespace {

std::string Write(const std::string& text) {
  const std::string path = ::testing::TempDir() + "/presets_" + std::to_string(std::rand()) + ".json";
  std::ofstream(path) << text;
  return path;
}

TEST(BenchPresetsTest, ReadsThePresetsInOrder) {
  auto presets = LoadPresets(Write(R"({"presets": [{"name": "a", "groups": 8, "rows_per_group": 64, "k": 128,
      "n": 256}, {"name": "b", "groups": 1, "rows_per_group": 2, "k": 3, "n": 4}]})"));
  ASSERT_TRUE(presets.ok()) << presets.status();
  ASSERT_EQ(presets->size(), 2u);
  EXPECT_EQ((*presets)[0].name, "a");
  EXPECT_EQ((*presets)[0].g * (*presets)[0].m, 512);
  EXPECT_EQ((*presets)[1].n, 4);
}

TEST(BenchPresetsTest, BadFilesAreRefusedNamingWhat) {
  EXPECT_EQ(LoadPresets("/nonexistent/presets.json").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadPresets(Write("{not json")).status().code(), absl::StatusCode::kInvalidArgument);
  auto zero = LoadPresets(Write(R"({"presets": [{"name": "z", "groups": 0, "rows_per_group": 1, "k": 1, "n": 1}]})"));
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("\"groups\""), std::string::npos) << zero.status();
  EXPECT_NE(zero.status().message().find("(z)"), std::string::npos) << zero.status();
  EXPECT_FALSE(LoadPresets(Write(R"({"presets": [{"groups": 1}]})")).ok());
}

}  // namespace
}  // namespace cuda
}  // namespace shardgemm
