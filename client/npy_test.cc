#include "client/npy.h"

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

TEST(NpyTest, RoundTripsEveryDType) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kI32, DType::kI64}) {
    auto t = *ZerosTensor(d, {3, 5});
    for (size_t i = 0; i < t.bytes.size(); ++i) t.bytes[i] = static_cast<char>(i * 7);
    std::string file = SerializeNpy(t);
    EXPECT_EQ((file.size() - t.bytes.size()) % 64, 0u);
    auto back = ParseNpy(file);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->dtype, d);
    EXPECT_EQ(back->shape, t.shape);
    EXPECT_EQ(back->bytes, t.bytes);
  }
}

TEST(NpyTest, ParsesNumpyWrittenHeaders) {
  // As numpy 1.26 writes np.arange(4, dtype=np.float32).reshape(2, 2) and a 1-D array.
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
  header.append(117 - header.size(), ' ');
  header.push_back('\n');
  std::string file = std::string("\x93NUMPY\x01\x00", 8) + static_cast<char>(118) + '\0' + header +
                     std::string(16, '\0');
  auto t = ParseNpy(file);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 2}));
  std::string h1 = "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }\n";
  std::string f1 = std::string("\x93NUMPY\x01\x00", 8) + static_cast<char>(h1.size()) + '\0' + h1 +
                   std::string(24, '\0');
  EXPECT_EQ(ParseNpy(f1)->shape, (std::vector<int64_t>{3}));
}

TEST(NpyTest, RejectsBadFiles) {
  EXPECT_FALSE(ParseNpy("hello").ok());
  auto t = *ZerosTensor(DType::kF32, {4});
  std::string file = SerializeNpy(t);
  EXPECT_FALSE(ParseNpy(file.substr(0, file.size() - 1)).ok());  // truncated data
  std::string fortran = file;
  fortran.replace(fortran.find("False"), 5, "True ");
  EXPECT_FALSE(ParseNpy(fortran).ok());
  std::string complex = file;
  complex.replace(complex.find("<f4"), 3, "<c8");
  EXPECT_FALSE(ParseNpy(complex).ok());
}

}  // namespace
}  // namespace shardgemm
