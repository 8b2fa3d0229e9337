#include "client/response_phases.h"

#include "client/testdata/phases_test.pb.h"
#include "gtest/gtest.h"
#include "proto/shardgemm.pb.h"

namespace shardgemm {
namespace {

TEST(ResponsePhases, ReadsEveryDoubleFieldOfPhasesInOrder) {
  const ResponsePhases phases(testdata::WithPhases::descriptor());
  ASSERT_TRUE(phases.present());
  EXPECT_EQ(phases.names(), (std::vector<std::string>{"plan_seconds", "kernel_seconds"}));
  testdata::WithPhases r;
  r.mutable_phases()->set_plan_seconds(0.25);
  r.mutable_phases()->set_kernel_seconds(1.5);
  r.mutable_phases()->set_note("ignored");
  EXPECT_EQ(phases.Read(r), (std::vector<double>{0.25, 1.5}));
}

TEST(ResponsePhases, UnsetPhasesReadAsZero) {
  const ResponsePhases phases(testdata::WithPhases::descriptor());
  EXPECT_EQ(phases.Read(testdata::WithPhases()), (std::vector<double>{0, 0}));
}

TEST(ResponsePhases, NoPhasesMessageReadsNothing) {
  const ResponsePhases phases(testdata::WithoutPhases::descriptor());
  EXPECT_FALSE(phases.present());
  EXPECT_TRUE(phases.names().empty());
  testdata::WithoutPhases r;
  r.set_phases("not a message");
  EXPECT_TRUE(phases.Read(r).empty());
}

TEST(ResponsePhases, AResponseOfAnotherTypeReadsNothing) {
  const ResponsePhases phases(testdata::WithPhases::descriptor());
  EXPECT_TRUE(phases.Read(testdata::WithoutPhases()).empty());
}

// Whichever build of the wire this is: with GroupedGemmResponse.phases the
// reader finds its phases, without it none.
TEST(ResponsePhases, GroupedGemmResponseAsBuilt) {
  const ResponsePhases phases(v1::GroupedGemmResponse::descriptor());
  const bool has_field = v1::GroupedGemmResponse::descriptor()->FindFieldByName("phases") != nullptr;
  EXPECT_EQ(phases.present(), has_field);
  EXPECT_EQ(phases.names().empty(), !has_field);
  EXPECT_EQ(phases.Read(v1::GroupedGemmResponse()).size(), phases.names().size());
}

}  // namespace
}  // namespace shardgemm
