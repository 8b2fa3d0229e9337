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
  EXPECT_TRUE(registry.Register(Named("w", *first))->empty());
  auto again = registry.Claim("", "w", false);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(again.status().message().find("exists"), std::string::npos);
  // With overwrite: a new generation, and the old one comes back to retire.
  auto second = registry.Claim("", "w", true);
  ASSERT_TRUE(second.ok());
  EXPECT_NE(*second, *first);
  EXPECT_EQ(registry.Register(Named("w", *second))->shard_name, *first);
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
  EXPECT_FALSE(registry.Retire({"w@1", {{0, 1}}}));  // two requests still read it
  EXPECT_TRUE(registry.Unpin(a).empty());
  const std::vector<ShardCopies> gone = registry.Unpin(b);
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].AllNames(), std::vector<std::string>({"w@1", "w@1/standby-of-0"})) << "with its standby copy";
  // Unpinned and not retired: nothing to delete.
  (void)registry.Register(Named("x", "x@9"));
  std::vector<std::string> c;
  ASSERT_TRUE(registry.FindAndPin("", "x", &c).ok());
  EXPECT_TRUE(registry.Unpin(c).empty());
  EXPECT_TRUE(registry.Retire({"x@9", {}}));
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
  EXPECT_TRUE(registry.Register(Named("w", "w@b", "bob"))->empty()) << "Bob's put replaced nothing of Alice's";
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
  const ResidentRegistry::Rejoin rejoin =
      registry.Rejoined(1, {"kept@1"}, /*epoch=*/1, "worker rank 1 rejoined without its shard");
  EXPECT_EQ(rejoin.lost, 1);
  EXPECT_TRUE(rejoin.restore.empty()) << "one copy of each block: nothing to restore from";
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
  EXPECT_EQ(registry.Rejoined(1, {}, 2, "again").lost, 1) << "only not-yet-lost ones count";
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
  EXPECT_EQ(again.Reconcile({{"w@a", "stray@1"}, {}}, {1, 2}, &orphans).lost, 1);
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
  ASSERT_EQ(replaced->size(), 2u);
  EXPECT_EQ((*replaced)[0].shard_name, "w8@old");
  EXPECT_TRUE((*replaced)[1].empty());
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

namespace shardgemm {
namespace {

// "w" on a 4-rank mesh, each rank its own block (rows over (ep, fsdp)), two
// copies of each: rank r's block also on rank (r + 1) % 4.
Resident Replicated(const std::string& name = "w", const std::string& shard = "w@1") {
  Resident r = Named(name, shard);
  r.info.set_dtype(v1::F32);
  r.info.add_shape(8);
  r.info.add_shape(4);
  r.info.set_spec("((ep, fsdp), None)");
  r.info.set_replicas(2);
  r.block_of_rank = {0, 1, 2, 3};
  for (int b = 0; b < 4; ++b) r.standby.push_back({b, (b + 1) % 4});
  return r;
}

std::set<std::string> AllOn(const Resident& r, int rank) {
  const std::vector<std::string> names = r.NamesOn(rank);
  return std::set<std::string>(names.begin(), names.end());
}

TEST(ResidentRegistryReplicasTest, AReplacedWorkersCopiesAreRestoringThenBack) {
  ResidentRegistry registry;
  const Resident w = Replicated();
  (void)registry.Register(w);
  EXPECT_EQ(w.NamesOn(2), (std::vector<std::string>{"w@1", "w@1/standby-of-1"}));
  // Rank 2 comes back empty: its own block and its standby copy of rank 1's are missing.
  const ResidentRegistry::Rejoin rejoin = registry.Rejoined(2, {}, /*epoch=*/7, "worker rank 2 rejoined");
  EXPECT_EQ(rejoin.lost, 0);
  ASSERT_EQ(rejoin.restore.size(), 1u);
  const RestoreTask& task = rejoin.restore[0];
  EXPECT_EQ(task.rank, 2);
  EXPECT_EQ(task.epoch, 7u);
  EXPECT_EQ(task.missing, (std::vector<std::string>{"w@1", "w@1/standby-of-1"}));
  // Until it is back: UNAVAILABLE (never NOT_FOUND, never DATA_LOSS), listed as restoring.
  auto found = registry.Find("", "w");
  EXPECT_EQ(found.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(found.status().message().find("restored"), std::string::npos) << found.status();
  std::vector<std::string> pins;
  EXPECT_EQ(registry.FindAndPin("", "w", &pins).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(pins.empty());
  ASSERT_EQ(registry.List("").size(), 1u);
  EXPECT_TRUE(registry.List("")[0].restoring());
  EXPECT_EQ(registry.RestoringCount(), 1);
  // Rank 2's block is on rank 3 (standby); rank 1's on rank 1 itself.
  auto own = registry.RestoreSources(task, "w@1");
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_EQ(own->size(), 1u);
  EXPECT_EQ((*own)[0].rank, 3);
  EXPECT_EQ((*own)[0].shard_name, "w@1/standby-of-2");
  auto standby = registry.RestoreSources(task, "w@1/standby-of-1");
  ASSERT_TRUE(standby.ok());
  ASSERT_EQ(standby->size(), 1u);
  EXPECT_EQ((*standby)[0].rank, 1);
  EXPECT_EQ((*standby)[0].shard_name, "w@1");
  // A task of an older registration of the rank does not end it.
  RestoreTask stale = task;
  stale.epoch = 6;
  EXPECT_FALSE(registry.FinishRestoring(stale));
  EXPECT_EQ(registry.RestoreSources(stale, "w@1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.FinishRestoring(task));
  EXPECT_TRUE(registry.Find("", "w").ok());
  EXPECT_FALSE(registry.List("")[0].restoring());
}

TEST(ResidentRegistryReplicasTest, ASecondLossBeforeTheRestoreLosesOnlyWhatHadNoOtherCopy) {
  ResidentRegistry registry;
  (void)registry.Register(Replicated());
  const ResidentRegistry::Rejoin first = registry.Rejoined(2, {}, 1, "worker rank 2 rejoined");
  ASSERT_EQ(first.restore.size(), 1u);
  // Rank 3 goes too before rank 2 is back: rank 2's block was on 2 and 3 only.
  const ResidentRegistry::Rejoin second = registry.Rejoined(3, {}, 2, "worker rank 3 rejoined without its shard");
  EXPECT_EQ(second.lost, 1);
  EXPECT_TRUE(second.restore.empty());
  auto found = registry.Find("", "w");
  EXPECT_EQ(found.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(found.status().message().find("no other worker holds a copy"), std::string::npos) << found.status();
  EXPECT_FALSE(registry.FinishRestoring(first.restore[0])) << "lost is final";
}

TEST(ResidentRegistryReplicasTest, AFailedRestoreIsLossAndADeleteEndsIt) {
  ResidentRegistry registry;
  (void)registry.Register(Replicated("a", "a@1"));
  (void)registry.Register(Replicated("b", "b@1"));
  const ResidentRegistry::Rejoin rejoin = registry.Rejoined(0, {}, 1, "worker rank 0 rejoined");
  ASSERT_EQ(rejoin.restore.size(), 2u);
  for (const RestoreTask& t : rejoin.restore) {
    if (t.name == "a") registry.FailRestoring(t, "its copies could not be read");
  }
  EXPECT_EQ(registry.Find("", "a").status().code(), absl::StatusCode::kDataLoss);
  auto removed = registry.Remove("", "b");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(removed->AllNames().size(), 5u) << "the shard and its four standby copies";
  for (const RestoreTask& t : rejoin.restore) {
    if (t.name == "b") {
      EXPECT_FALSE(registry.FinishRestoring(t));
      EXPECT_EQ(registry.RestoreSources(t, "b@1").status().code(), absl::StatusCode::kNotFound);
    }
  }
  EXPECT_EQ(registry.RestoringCount(), 0);
}

TEST(ResidentRegistryReplicasTest, ANewGenerationIsWholeAndOneCopyTensorsAreLostAsBefore) {
  ResidentRegistry registry;
  (void)registry.Register(Replicated());
  Resident single = Named("single", "single@1");
  single.info.set_replicas(1);
  single.block_of_rank = {0, 0, 0, 0};  // replicated over the mesh, but put with one copy per block
  (void)registry.Register(single);
  const ResidentRegistry::Rejoin rejoin = registry.Rejoined(1, {}, 1, "worker rank 1 rejoined without its shard");
  EXPECT_EQ(rejoin.lost, 1) << "--replicas=1: lost, never served from the other ranks' copies";
  EXPECT_EQ(registry.Find("", "single").status().code(), absl::StatusCode::kDataLoss);
  ASSERT_EQ(rejoin.restore.size(), 1u);
  ASSERT_TRUE(registry.Claim("", "w", /*overwrite=*/true).ok());
  auto replaced = registry.Register(Replicated("w", "w@2"));
  ASSERT_TRUE(replaced.ok());
  EXPECT_EQ(replaced->shard_name, "w@1");
  EXPECT_TRUE(registry.Find("", "w").ok()) << "the new generation is on every rank";
  EXPECT_FALSE(registry.FinishRestoring(rejoin.restore[0]));
}

TEST(ResidentRegistryReplicasTest, StandbyBytesCountOnTheirHolders) {
  ResidentRegistry registry;
  (void)registry.Register(Replicated());  // 8x4 F32 over 4 blocks: 32 bytes a block
  EXPECT_EQ(registry.StandbyBytesByRank(4), (std::vector<int64_t>{32, 32, 32, 32}));
  EXPECT_EQ(registry.ResidentBytesByRank(4), (std::vector<int64_t>{64, 64, 64, 64}));
}

TEST(ResidentRegistryReplicasTest, TheCopiesAreWrittenDownAndARestartRestoresFromWhatTheRanksReport) {
  char dir[] = "/tmp/shardgemm_replicas_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/registry.pb";
  const Resident w = Replicated();
  {
    ResidentRegistry registry;
    ASSERT_TRUE(registry.MakeDurable(path).ok());
    ASSERT_TRUE(registry.Register(w).ok());
  }
  ResidentRegistry again;
  ASSERT_TRUE(again.MakeDurable(path).ok());
  auto loaded = again.Find("", "w");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->block_of_rank, w.block_of_rank);
  EXPECT_EQ(loaded->standby, w.standby);
  EXPECT_EQ(loaded->info.replicas(), 2);
  // Rank 1 came back empty; the others report every copy they hold, and a stray.
  std::vector<std::set<std::string>> held = {AllOn(w, 0), {}, AllOn(w, 2), AllOn(w, 3)};
  held[3].insert("stray@1");
  std::vector<std::string> orphans;
  const ResidentRegistry::Rejoin reconciled = again.Reconcile(held, {1, 2, 3, 4}, &orphans);
  EXPECT_EQ(orphans, std::vector<std::string>({"stray@1"})) << "standby copies are no orphans";
  EXPECT_EQ(reconciled.lost, 0);
  ASSERT_EQ(reconciled.restore.size(), 1u);
  EXPECT_EQ(reconciled.restore[0].rank, 1);
  EXPECT_EQ(reconciled.restore[0].epoch, 2u);
  EXPECT_EQ(again.Find("", "w").status().code(), absl::StatusCode::kUnavailable);
}

TEST(ResidentRegistryReplicasTest, ARestartWhereABlocksEveryCopyIsGoneIsLoss) {
  ResidentRegistry registry;
  const Resident w = Replicated();
  (void)registry.Register(w);
  // Ranks 1 and 2 empty: rank 1's block was on 1 and 2 only.
  std::vector<std::string> orphans;
  const ResidentRegistry::Rejoin reconciled =
      registry.Reconcile({AllOn(w, 0), {}, {}, AllOn(w, 3)}, {1, 2, 3, 4}, &orphans);
  EXPECT_EQ(reconciled.lost, 1);
  EXPECT_TRUE(reconciled.restore.empty()) << "nothing of a lost tensor is restored";
  EXPECT_EQ(registry.Find("", "w").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(registry.RestoringCount(), 0);
}

}  // namespace
}  // namespace shardgemm
