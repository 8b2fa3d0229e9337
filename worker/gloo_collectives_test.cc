// Gloo collectives of two workers in one process (a store in memory, TCP on
// loopback): communicators by (epoch, group), revoked at once.
#include "worker/gloo_collectives.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gloo/rendezvous/hash_store.h"
#include "gtest/gtest.h"

namespace shardgemm {
namespace {

MeshPosition FsdpRank(int rank) {
  MeshPosition p;
  p.axis_names = {"fsdp"};
  p.axis_sizes = {2};
  p.coords = {rank};
  p.rank = rank;
  return p;
}

HostTensor Value(float v) {
  HostTensor t = *ZerosTensor(DType::kF32, {4});
  for (int i = 0; i < 4; ++i) t.data<float>()[i] = v + static_cast<float>(i);
  return t;
}

class GlooCollectivesTest : public ::testing::Test {
 protected:
  // Both members, with a collective timeout of `timeout`.
  void Make(std::chrono::milliseconds timeout) {
    auto store = std::make_shared<gloo::rendezvous::HashStore>();
    for (int r = 0; r < 2; ++r) members_[r] = MakeGlooCollectives(FsdpRank(r), store, "127.0.0.1", timeout);
  }

  // Step `sequence` of `epoch` on the members `on`, each summing its value
  // over fsdp; their statuses and sums (rank + 1 + rank + 1 ... : 3 + 2i).
  struct Sum {
    absl::Status status;
    HostTensor value;
    absl::Duration took;
  };
  std::vector<Sum> Step(uint64_t sequence, uint64_t epoch, std::vector<int> on) {
    std::vector<Sum> sums(on.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < on.size(); ++i) {
      threads.emplace_back([&, i] {
        Collectives& c = *members_[on[i]];
        c.BeginStep(sequence, epoch);
        sums[i].value = Value(static_cast<float>(on[i] + 1));
        const absl::Time start = absl::Now();
        sums[i].status = c.AllReduce(&sums[i].value, ReduceOp::kSum, {"fsdp"});
        sums[i].took = absl::Now() - start;
      });
    }
    for (auto& t : threads) t.join();
    return sums;
  }
  static void ExpectRight(const Sum& sum) {
    ASSERT_TRUE(sum.status.ok()) << sum.status;
    for (int i = 0; i < 4; ++i) EXPECT_EQ(sum.value.data<float>()[i], 3.0f + 2.0f * i) << i;
  }

  std::unique_ptr<Collectives> members_[2];
};

// A member left in a collective by a peer that never comes (the step lost
// on the way to it) is freed by the revoke, not its timeout, and the error
// says why.
TEST_F(GlooCollectivesTest, ARevokeEndsACollectiveBlockedOnAPeerAtOnce) {
  Make(std::chrono::seconds(30));
  for (const Sum& s : Step(1, 1, {0, 1})) ExpectRight(s);
  std::vector<Sum> alone;
  std::thread blocked([&] { alone = Step(2, 1, {0}); });
  absl::SleepFor(absl::Milliseconds(300));
  members_[0]->Revoke(2, "worker rank 1 is down");
  blocked.join();
  EXPECT_EQ(alone[0].status.code(), absl::StatusCode::kAborted) << alone[0].status;
  EXPECT_NE(alone[0].status.message().find("worker rank 1 is down"), std::string::npos) << alone[0].status;
  EXPECT_LT(alone[0].took, absl::Seconds(5)) << "not at the 30 s timeout";
  // The next epoch's first step builds the group afresh on both.
  for (const Sum& s : Step(3, 2, {0, 1})) ExpectRight(s);
}

// Revoked on one member only, a context fails on its peer too (its
// sockets close): two members left in different steps' collectives of one
// context both end at once.
TEST_F(GlooCollectivesTest, ARevokeOnOneMemberEndsItsPeersCollectiveOnTheContextToo) {
  Make(std::chrono::seconds(30));
  for (const Sum& s : Step(1, 1, {0, 1})) ExpectRight(s);
  std::vector<Sum> first, second;
  std::thread a([&] { first = Step(2, 1, {0}); });
  std::thread b([&] { second = Step(3, 1, {1}); });  // a step its peer did not run yet: tags differ
  absl::SleepFor(absl::Milliseconds(300));
  members_[0]->Revoke(2, "a step failed");
  a.join();
  b.join();
  EXPECT_EQ(first[0].status.code(), absl::StatusCode::kAborted) << first[0].status;
  EXPECT_FALSE(second[0].status.ok());
  EXPECT_LT(first[0].took, absl::Seconds(5));
  EXPECT_LT(second[0].took, absl::Seconds(5)) << second[0].status;
}

// The livelock this replaces: after a step only one member ran (its
// collective timed out there), contexts named by the step that built them
// were rebuilt by each member at a step of its own choosing: members that
// run their steps back to back, one a little behind the other, waited in
// rendezvous the other never joined, a timeout each, step after step.
// Named by the epoch, the failed epoch's later steps fail at once on both
// and both build the group at the next epoch's first step: right there.
TEST_F(GlooCollectivesTest, AfterAStepOneMemberMissedTheNextEpochsFirstStepIsRight) {
  Make(std::chrono::milliseconds(500));
  for (const Sum& s : Step(1, 1, {0, 1})) ExpectRight(s);
  const Sum missed = Step(2, 1, {0})[0];
  EXPECT_EQ(missed.status.code(), absl::StatusCode::kUnavailable) << missed.status;
  // Step 3 was numbered before the coordinator advanced the epoch, step 4
  // after; member 0 is 100 ms behind member 1.
  std::vector<Sum> behind[2], next[2];
  std::thread members[2];
  for (int r = 0; r < 2; ++r) {
    members[r] = std::thread([&, r] {
      if (r == 0) absl::SleepFor(absl::Milliseconds(100));
      behind[r] = Step(3, 1, {r});
      if (r == 0) absl::SleepFor(absl::Milliseconds(100));
      next[r] = Step(4, 2, {r});
    });
  }
  for (auto& m : members) m.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(behind[r][0].status.ok());
    EXPECT_LT(behind[r][0].took, absl::Milliseconds(400)) << "at once, not at the timeout: " << behind[r][0].status;
  }
  EXPECT_NE(behind[0][0].status.message().find("earlier in mesh epoch 1"), std::string::npos)
      << behind[0][0].status;
  ExpectRight(next[0][0]);
  ExpectRight(next[1][0]);
  for (const Sum& s : Step(5, 2, {0, 1})) ExpectRight(s);
}

// A step of an epoch older than the newest known communicates with no one:
// its collective fails at once (a context built for it could pair with a
// peer's of another epoch).
TEST_F(GlooCollectivesTest, AStepOfARevokedEpochFailsAtOnceWithoutCommunicating) {
  Make(std::chrono::seconds(30));
  for (const Sum& s : Step(1, 1, {0, 1})) ExpectRight(s);
  members_[0]->Revoke(3, "a worker took rank 1");
  members_[0]->Revoke(3, "");  // the same epoch again: nothing changes
  const Sum old = Step(2, 2, {0})[0];
  EXPECT_EQ(old.status.code(), absl::StatusCode::kAborted) << old.status;
  EXPECT_NE(old.status.message().find("epoch 2"), std::string::npos) << old.status;
  EXPECT_NE(old.status.message().find("a worker took rank 1"), std::string::npos) << old.status;
  EXPECT_LT(old.took, absl::Seconds(1));
  for (const Sum& s : Step(3, 3, {0, 1})) ExpectRight(s);
}

}  // namespace
}  // namespace shardgemm
