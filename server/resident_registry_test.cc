#include "server/resident_registry.h"

#include <stdlib.h>

#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace shardgemm {
namespace {

Resident Named(const std::string& name, const std::string& shard, const std::string& tenant = "") {
  Resident r;
  r.tenant = tenant;
  r.info.set_name(name);
  r.shard_name = shard;
  return r;
}

TEST(ResidentRegistryTest, ClaimGivesANewGenerationAndRefusesAResidentName) {
  ResidentRegistry registry;
  auto first = registry.Claim("", "w", /*overwrite=*/false);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->rfind("w@", 0), 0u) << *first;
  // A second request may not make the same name while the first runs.
  EXPECT_EQ(registry.Claim("", "w", false).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(*registry.Register(Named("w", *first)), "");
  auto again = registry.Claim("", "w", false);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(again.status().message().find("exists"), std::string::npos);
  // With overwrite: a new generation, and the old one comes back to retire.
  auto second = registry.Claim("", "w", true);
  ASSERT_TRUE(second.ok());
  EXPECT_NE(*second, *first);
  EXPECT_EQ(*registry.Register(Named("w", *second)), *first);
  EXPECT_EQ(registry.Find("", "w")->shard_name, *second);
}

TEST(ResidentRegistryTest, ReleasedClaimFreesTheName) {
  ResidentRegistry registry;
  ASSERT_TRUE(registry.Claim("", "y", false).ok());
  registry.Release("", "y");  // the request failed
  EXPECT_TRUE(registry.Claim("", "y", false).ok());
  EXPECT_EQ(registry.Find("", "y").status().code(), absl::StatusCode::kNotFound);
}

TEST(ResidentRegistryTest, PinnedGenerationLeavesOnlyAfterItsLastRequest) {
  ResidentRegistry registry;
  (void)registry.Register(Named("w", "w@1"));
  std::vector<std::string> a, b;
  ASSERT_TRUE(registry.FindAndPin("", "w", &a).ok());
  ASSERT_TRUE(registry.FindAndPin("", "w", &b).ok());
  ASSERT_TRUE(registry.Remove("", "w").ok());
  EXPECT_FALSE(registry.Retire("w@1"));  // two requests still read it
  EXPECT_TRUE(registry.Unpin(a).empty());
  EXPECT_EQ(registry.Unpin(b), std::vector<std::string>({"w@1"}));
  // Unpinned and not retired: nothing to delete.
  (void)registry.Register(Named("x", "x@9"));
  std::vector<std::string> c;
  ASSERT_TRUE(registry.FindAndPin("", "x", &c).ok());
  EXPECT_TRUE(registry.Unpin(c).empty());
  EXPECT_TRUE(registry.Retire("x@9"));
}

TEST(ResidentRegistryTest, MissingNamesAreNotFound) {
  ResidentRegistry registry;
  std::vector<std::string> pins;
  EXPECT_EQ(registry.Find("", "z").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.FindAndPin("", "z", &pins).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(pins.empty());
  EXPECT_EQ(registry.Remove("", "z").status().code(), absl::StatusCode::kNotFound);
}

TEST(ResidentRegistryTest, ListIsSortedByName) {
  ResidentRegistry registry;
  for (const char* n : {"b", "a", "c"}) (void)registry.Register(Named(n, std::string(n) + "@1"));
  std::vector<std::string> names;
  for (const auto& info : registry.List("")) names.push_back(info.name());
  EXPECT_EQ(names, std::vector<std::string>({"a", "b", "c"}));
}

TEST(ResidentRegistryTest, GenerationsAreNotGuessable) {
  ResidentRegistry registry;
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    auto claimed = registry.Claim("", "w", /*overwrite=*/true);
    ASSERT_TRUE(claimed.ok());
    EXPECT_TRUE(seen.insert(*claimed).second) << "a generation came twice: " << *claimed;
    EXPECT_EQ(claimed->size(), std::string("w@").size() + 16) << *claimed;
  }
}

TEST(ResidentRegistryTest, EachTenantHasItsOwnNamespace) {
  ResidentRegistry registry;
  ASSERT_TRUE(registry.Claim("alice", "w", false).ok());
  (void)registry.Register(Named("w", "w@a", "alice"));
  // Bob sees no "w": he cannot find, pin, list or remove Alice's, and may make his own.
  std::vector<std::string> pins;
  EXPECT_EQ(registry.Find("bob", "w").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.FindAndPin("bob", "w", &pins).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(pins.empty());
  EXPECT_TRUE(registry.List("bob").empty());
  EXPECT_EQ(registry.Remove("bob", "w").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry.Claim("bob", "w", /*overwrite=*/false).ok()) << "Alice's name is not Bob's";
  EXPECT_EQ(*registry.Register(Named("w", "w@b", "bob")), "") << "Bob's put replaced nothing of Alice's";
  EXPECT_EQ(registry.Find("alice", "w")->shard_name, "w@a");
  EXPECT_EQ(registry.Find("bob", "w")->shard_name, "w@b");
  EXPECT_EQ(registry.List("alice").size(), 1u);
  EXPECT_EQ(registry.ListAll().size(), 2u);
  EXPECT_EQ(registry.Count("alice"), 1);
  ASSERT_TRUE(registry.Claim("alice", "pending", false).ok());
  EXPECT_EQ(registry.Count("alice"), 2) << "a tensor being made counts";
  EXPECT_EQ(registry.Count("carol"), 0);
}

TEST(ResidentRegistryTest, NamesAreValidated) {
  EXPECT_TRUE(ValidateResidentName("name", "experts.0").ok());
  EXPECT_TRUE(ValidateResidentName("name", std::string(kMaxResidentNameBytes, 'a')).ok());
  for (const std::string& bad : {std::string(""), std::string(kMaxResidentNameBytes + 1, 'a'), std::string("a@1"),
                                 std::string("a\nb"), std::string("a\x7f")}) {
    absl::Status s = ValidateResidentName("keep_output_as", bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.message().rfind("keep_output_as", 0), 0u) << s;
  }
}

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

TEST(ResidentRegistryTest, TensorsWhoseShardARejoinedWorkerLacksAreLost) {
  ResidentRegistry registry;
  (void)registry.Register(Named("kept", "kept@1"));
  (void)registry.Register(Named("gone", "gone@1"));
  EXPECT_EQ(registry.MarkLostUnlessHeld({"kept@1"}, "worker rank 1 rejoined without its shard"), 1);
  EXPECT_TRUE(registry.Find("", "kept").ok());
  auto gone = registry.Find("", "gone");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(gone.status().message().find("worker rank 1"), std::string::npos);
  std::vector<std::string> pins;
  EXPECT_EQ(registry.FindAndPin("", "gone", &pins).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(pins.empty());
  EXPECT_TRUE(registry.IsLost("", "gone"));
  bool listed_lost = false;
  for (const auto& info : registry.List("")) listed_lost |= info.name() == "gone" && info.lost();
  EXPECT_TRUE(listed_lost);
  EXPECT_TRUE(registry.Remove("", "gone").ok()) << "a lost tensor can be deleted";
  EXPECT_EQ(registry.MarkLostUnlessHeld({}, "again"), 1) << "only not-yet-lost ones count";
}

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

TEST(ResidentRegistryTest, ADurableRegistryComesBackFromItsFile) {
  char dir[] = "/tmp/shardgemm_registry_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/registry.pb";
  {
    ResidentRegistry registry;
    ASSERT_TRUE(registry.MakeDurable(path).ok());
    Resident w = Named("w", "w@a", "alice");
    w.info.set_spec("(ep, None)");
    (void)registry.Register(w);
    Resident x = Named("x", "x@b", "bob");
    x.info.set_spec("(None, fsdp)");
    (void)registry.Register(x);
    ASSERT_TRUE(registry.Remove("bob", "x").ok());
  }
  ResidentRegistry again;
  ASSERT_TRUE(again.MakeDurable(path).ok());
  auto w = again.Find("alice", "w");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->shard_name, "w@a");
  EXPECT_EQ(planner::FormatPartitionSpec(w->spec), "(ep, None)");
  EXPECT_EQ(again.Find("bob", "x").status().code(), absl::StatusCode::kNotFound) << "the delete was kept too";
  // Reconciled with what the ranks hold: rank 1 lacks w's shard; "stray" is no one's.
  std::vector<std::string> orphans;
  EXPECT_EQ(again.Reconcile({{"w@a", "stray@1"}, {}}, &orphans), 1);
  EXPECT_EQ(orphans, std::vector<std::string>({"stray@1"}));
  EXPECT_EQ(again.Find("alice", "w").status().code(), absl::StatusCode::kDataLoss);
  std::ofstream(path) << "garbage";
  ResidentRegistry broken;
  EXPECT_EQ(broken.MakeDurable(path).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

TEST(ResidentRegistryTest, TheTenantLimitIsCountedWithTheClaim) {
  ResidentRegistry registry;
  ASSERT_TRUE(registry.Claim("alice", "a", false, /*max_per_tenant=*/2).ok());
  ASSERT_TRUE(registry.Claim("alice", "b", false, 2).ok());  // being made: counted already
  auto third = registry.Claim("alice", "c", false, 2);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("max_tensors_per_tenant"), std::string::npos);
  EXPECT_TRUE(registry.Claim("bob", "c", false, 2).ok()) << "another tenant's room is its own";
  (void)registry.Register(Named("a", "a@1", "alice"));
  EXPECT_TRUE(registry.Claim("alice", "a", /*overwrite=*/true, 2).ok()) << "replacing its own adds nothing";
}

}  // namespace
}  // namespace shardgemm

namespace shardgemm {
namespace {

TEST(ResidentRegistryTest, APutOrDeleteThatCannotBeWrittenDownIsRefusedAndChangesNothing) {
  char dir[] = "/tmp/shardgemm_unwritable_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/registry.pb";
  ResidentRegistry registry;
  ASSERT_TRUE(registry.MakeDurable(path).ok());
  Resident kept = Named("kept", "kept@1");
  kept.info.set_spec("(dp, None)");
  ASSERT_TRUE(registry.Register(kept).ok());
  std::remove(path.c_str());
  ASSERT_EQ(rmdir(dir), 0);  // the state directory is gone: nothing can be written
  ASSERT_TRUE(registry.Claim("", "new", false).ok());
  Resident fresh = Named("new", "new@1");
  fresh.info.set_spec("(dp, None)");
  auto put = registry.Register(fresh);
  EXPECT_EQ(put.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(put.status().message().find("state_dir"), std::string::npos);
  EXPECT_EQ(registry.Find("", "new").status().code(), absl::StatusCode::kNotFound) << "not kept";
  EXPECT_TRUE(registry.Claim("", "new", false).ok()) << "and its claim was released";
  EXPECT_EQ(registry.Remove("", "kept").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(registry.Find("", "kept").ok()) << "not deleted either";
}

// A quantize keeping its data and scales registers both or neither: a
// pair that cannot be written down leaves the names as they were.
TEST(ResidentRegistryTest, RegisterAllKeepsAllOrNone) {
  char dir[] = "/tmp/shardgemm_pair_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/registry.pb";
  ResidentRegistry registry;
  ASSERT_TRUE(registry.MakeDurable(path).ok());
  ASSERT_TRUE(registry.Register(Named("w8", "w8@old")).ok());
  for (const char* name : {"w8", "w8_scale"}) ASSERT_TRUE(registry.Claim("", name, /*overwrite=*/true).ok());
  std::vector<Resident> pair = {Named("w8", "w8@new"), Named("w8_scale", "w8_scale@new")};
  auto replaced = registry.RegisterAll(pair);
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  EXPECT_EQ(*replaced, (std::vector<std::string>{"w8@old", ""}));
  EXPECT_EQ(registry.Find("", "w8_scale")->shard_name, "w8_scale@new");
  std::remove(path.c_str());
  ASSERT_EQ(rmdir(dir), 0);
  for (const char* name : {"w8", "w8_scale"}) ASSERT_TRUE(registry.Claim("", name, /*overwrite=*/true).ok());
  auto failed = registry.RegisterAll({Named("w8", "w8@third"), Named("w8_scale", "w8_scale@third")});
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(registry.Find("", "w8")->shard_name, "w8@new") << "neither replaced";
  EXPECT_EQ(registry.Find("", "w8_scale")->shard_name, "w8_scale@new");
  EXPECT_TRUE(registry.Claim("", "w8", true).ok()) << "claims released";
}

}  // namespace
}  // namespace shardgemm
