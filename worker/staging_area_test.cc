#include "worker/staging_area.h"

#include <cstring>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/fake_staging_memory.h"

namespace shardgemm {
namespace {

using ::testing::HasSubstr;

constexpr char kTicket[] = "0123456789abcdef0123456789abcdef";

ExpectedBlock Block(std::string tenant = "demo", std::vector<int64_t> shape = {2, 4}) {
  ExpectedBlock b;
  b.tenant = std::move(tenant);
  b.operand = "the lhs block";
  b.dtype = DType::kF32;
  b.shape = std::move(shape);
  return b;
}

class StagingAreaTest : public ::testing::Test {
 protected:
  absl::Time now_ = absl::FromUnixSeconds(1000);
  StagingArea area_{1024, absl::Seconds(60), [this] { return now_; }};

  absl::Status Stage(const std::string& ticket, const std::string& data, const std::string& tenant = "demo") {
    auto up = area_.BeginStage(ticket, tenant);
    if (!up.ok()) return up.status();
    if (auto s = (*up)->Append(data); !s.ok()) return s;
    return (*up)->Commit().status();
  }
};

TEST_F(StagingAreaTest, StagedBlockIsClaimedOnceAndFreesItsBytes) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  const std::string bytes(32, '\x7');
  auto up = area_.BeginStage(kTicket, "demo");
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(area_.held_bytes(), 32);  // reserved while it arrives
  ASSERT_TRUE((*up)->Append(bytes.substr(0, 10)).ok());
  ASSERT_TRUE((*up)->Append(bytes.substr(10)).ok());
  ASSERT_TRUE((*up)->Commit().ok());
  up->reset();
  EXPECT_EQ(area_.held_bytes(), 32);
  auto t = area_.Claim(kTicket, DType::kF32, {2, 4}, "lhs");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->bytes, bytes);
  EXPECT_EQ(area_.held_bytes(), 0);
  auto again = area_.Claim(kTicket, DType::kF32, {2, 4}, "lhs");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("used already"));
  EXPECT_EQ(Stage(kTicket, bytes).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(StagingAreaTest, UnknownTicketIsNotFound) {
  EXPECT_EQ(area_.BeginStage(kTicket, "demo").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(area_.Claim(kTicket, DType::kF32, {2, 4}, "lhs").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(area_.BeginFetch(kTicket, "demo").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(StagingAreaTest, AnotherTenantsTicketIsPermissionDenied) {
  ASSERT_TRUE(area_.Expect(kTicket, Block("demo")).ok());
  auto up = area_.BeginStage(kTicket, "other");
  EXPECT_EQ(up.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_TRUE(Stage(kTicket, std::string(32, 'a'), "demo").ok());  // its own tenant still may
}

TEST_F(StagingAreaTest, WrongSizeIsInvalidArgumentNamingTheExpectedBytesAndHoldsNothing) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  absl::Status s = Stage(kTicket, std::string(31, 'a'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("expects 32"));
  EXPECT_EQ(area_.held_bytes(), 0);
  s = Stage(kTicket, std::string(33, 'a'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("32 bytes"));
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_TRUE(Stage(kTicket, std::string(32, 'a')).ok());  // the ticket may be staged again
}

TEST_F(StagingAreaTest, StreamEndedMidwayLeavesNothingHeld) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  {
    auto up = area_.BeginStage(kTicket, "demo");
    ASSERT_TRUE(up.ok());
    ASSERT_TRUE((*up)->Append(std::string(16, 'a')).ok());
    // A second stream while the first is open is refused.
    EXPECT_EQ(area_.BeginStage(kTicket, "demo").status().code(), absl::StatusCode::kFailedPrecondition);
  }  // the client went away
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_EQ(area_.Claim(kTicket, DType::kF32, {2, 4}, "lhs").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(StagingAreaTest, BudgetIsResourceExhaustedNamingTheFlag) {
  ASSERT_TRUE(area_.Expect(kTicket, Block("demo", {256, 2})).ok());  // 2048 bytes > 1024
  auto up = area_.BeginStage(kTicket, "demo");
  EXPECT_EQ(up.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(up.status().message(), HasSubstr("--staging_budget"));
  EXPECT_EQ(area_.held_bytes(), 0);
}

TEST_F(StagingAreaTest, WrongDtypeOrShapeAtClaimIsInvalidArgumentAndKeepsTheBlock) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  ASSERT_TRUE(Stage(kTicket, std::string(32, 'a')).ok());
  auto t = area_.Claim(kTicket, DType::kF32, {4, 2}, "rhs");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("rhs.staged"));
  EXPECT_EQ(area_.Claim(kTicket, DType::kBF16, {2, 4}, "rhs").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(area_.held_bytes(), 32);
  EXPECT_TRUE(area_.Claim(kTicket, DType::kF32, {2, 4}, "rhs").ok());
}

TEST_F(StagingAreaTest, UnclaimedBlocksExpireOnAccessAndBySweep) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  ASSERT_TRUE(Stage(kTicket, std::string(32, 'a')).ok());
  ASSERT_TRUE(area_.Expect("ffffffffffffffffffffffffffffffff", Block()).ok());
  now_ += absl::Seconds(59);
  EXPECT_EQ(area_.Sweep(), 0);
  EXPECT_EQ(area_.held_bytes(), 32);
  now_ += absl::Seconds(2);
  EXPECT_EQ(area_.Claim(kTicket, DType::kF32, {2, 4}, "lhs").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_EQ(area_.Sweep(), 1);  // the other, never staged
  EXPECT_EQ(area_.tickets(), 0u);
}

TEST_F(StagingAreaTest, UsedTicketIsForgottenAfterItsExpiry) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  ASSERT_TRUE(Stage(kTicket, std::string(32, 'a')).ok());
  ASSERT_TRUE(area_.Claim(kTicket, DType::kF32, {2, 4}, "lhs").ok());
  now_ += absl::Seconds(61);
  EXPECT_EQ(area_.Sweep(), 1);
  EXPECT_EQ(area_.tickets(), 0u);
}

TEST_F(StagingAreaTest, DiscardFreesAStagedBlockAndRefusesALateOne) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  ASSERT_TRUE(Stage(kTicket, std::string(32, 'a')).ok());
  const std::string late = "ffffffffffffffffffffffffffffffff";
  ASSERT_TRUE(area_.Expect(late, Block()).ok());
  area_.Discard(kTicket);
  area_.Discard(late);
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_EQ(area_.Claim(kTicket, DType::kF32, {2, 4}, "lhs").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Stage(late, std::string(32, 'a')).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(StagingAreaTest, DiscardDuringAStreamFailsItsCommitAndFreesItsReservation) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  auto up = area_.BeginStage(kTicket, "demo");
  ASSERT_TRUE(up.ok());
  ASSERT_TRUE((*up)->Append(std::string(32, 'a')).ok());
  EXPECT_EQ(area_.held_bytes(), 32);
  area_.Discard(kTicket);
  auto committed = (*up)->Commit();
  EXPECT_EQ(committed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(committed.status().message(), HasSubstr("dropped"));
  up->reset();
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_EQ(Stage(kTicket, std::string(32, 'a')).code(), absl::StatusCode::kFailedPrecondition);  // used
}

TEST_F(StagingAreaTest, HeldOutputIsFetchedOnceByItsTenant) {
  HostTensor out;
  out.dtype = DType::kF32;
  out.shape = {2, 2};
  out.bytes.assign(16, 'o');
  ASSERT_TRUE(area_.Hold(kTicket, "demo", out).ok());
  EXPECT_EQ(area_.held_bytes(), 16);
  EXPECT_EQ(area_.BeginFetch(kTicket, "other").status().code(), absl::StatusCode::kPermissionDenied);
  {
    auto d = area_.BeginFetch(kTicket, "demo");
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(area_.BeginFetch(kTicket, "demo").status().code(), absl::StatusCode::kFailedPrecondition);
  }  // not done: the client went away; it may fetch again
  EXPECT_EQ(area_.held_bytes(), 16);
  auto d = area_.BeginFetch(kTicket, "demo");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ((*d)->block().bytes, out.bytes);
  (*d)->Done();
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_EQ(area_.BeginFetch(kTicket, "demo").status().code(), absl::StatusCode::kFailedPrecondition);
  // A staging stream to an output's ticket is refused.
  EXPECT_EQ(area_.BeginStage(kTicket, "demo").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(StagingAreaTest, OutputOverBudgetIsResourceExhausted) {
  HostTensor out;
  out.dtype = DType::kF32;
  out.shape = {512};
  out.bytes.assign(2048, 'o');
  absl::Status s = area_.Hold(kTicket, "demo", out);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("--staging_budget"));
  EXPECT_EQ(area_.held_bytes(), 0);
}

TEST_F(StagingAreaTest, UnfetchedOutputExpires) {
  HostTensor out;
  out.dtype = DType::kF32;
  out.shape = {2};
  out.bytes.assign(8, 'o');
  ASSERT_TRUE(area_.Hold(kTicket, "demo", out).ok());
  now_ += absl::Seconds(61);
  EXPECT_EQ(area_.Sweep(), 1);
  EXPECT_EQ(area_.held_bytes(), 0);
}

TEST_F(StagingAreaTest, ExpiryDuringAnUploadFailsItsCommitAndFreesItsReservation) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  auto up = area_.BeginStage(kTicket, "demo");
  ASSERT_TRUE(up.ok());
  ASSERT_TRUE((*up)->Append(std::string(32, 'a')).ok());
  now_ += absl::Seconds(61);
  EXPECT_EQ(area_.Sweep(), 1);
  EXPECT_EQ((*up)->Commit().status().code(), absl::StatusCode::kNotFound);
  up->reset();
  EXPECT_EQ(area_.held_bytes(), 0);
}

// The coordinator's stream of a put (StageTtl::kFromLastData) takes as long
// as its client does, so long as no TTL passes without a byte; a client's
// own stage keeps the TTL from the ticket's issue (trickled bytes hold nothing longer).
TEST_F(StagingAreaTest, AStreamWhoseTtlRestartsWithDataOutlivesTheTtlWhileBytesKeepComing) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  int cancels = 0;
  auto up = area_.BeginStage(kTicket, "demo", [&] { ++cancels; }, StagingArea::StageTtl::kFromLastData);
  ASSERT_TRUE(up.ok());
  for (int i = 0; i < 4; ++i) {  // 4 pieces 50 s apart: 200 s in all, past three TTLs
    now_ += absl::Seconds(50);
    EXPECT_EQ(area_.Sweep(), 0);
    ASSERT_TRUE((*up)->Append(std::string(8, static_cast<char>('a' + i))).ok()) << i;
  }
  auto staged = (*up)->Commit();
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(cancels, 0);
  now_ += absl::Seconds(50);  // a staged block waits a TTL for its step, from its commit
  auto claimed = area_.Claim(kTicket, DType::kF32, {2, 4}, "shard");
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  EXPECT_EQ(claimed->bytes, std::string(8, 'a') + std::string(8, 'b') + std::string(8, 'c') + std::string(8, 'd'));
  EXPECT_EQ(area_.held_bytes(), 0);
}

TEST_F(StagingAreaTest, AStreamWhoseTtlRestartsWithDataExpiresATtlAfterItsLastByte) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  int cancels = 0;
  auto up = area_.BeginStage(kTicket, "demo", [&] { ++cancels; }, StagingArea::StageTtl::kFromLastData);
  ASSERT_TRUE(up.ok());
  now_ += absl::Seconds(50);
  ASSERT_TRUE((*up)->Append(std::string(8, 'a')).ok());
  now_ += absl::Seconds(61);
  EXPECT_EQ(area_.Sweep(), 1);
  EXPECT_EQ(cancels, 1);  // the sweep ends its stream
  absl::Status late = (*up)->Append(std::string(8, 'b'));
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(late.message(), HasSubstr("nothing arrived for 1m"));
  EXPECT_EQ(area_.held_bytes(), 32);  // the open stream's reservation, until it ends
  up->reset();
  EXPECT_EQ(area_.held_bytes(), 0);
}

// The coordinator's bound on its own waits, when longer than the TTL, is the stream's.
TEST_F(StagingAreaTest, AStreamWhoseTtlRestartsWithDataWaitsTheCoordinatorsBoundIfLonger) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  int cancels = 0;
  auto up = area_.BeginStage(kTicket, "demo", [&] { ++cancels; }, StagingArea::StageTtl::kFromLastData,
                             absl::Seconds(240));
  ASSERT_TRUE(up.ok());
  now_ += absl::Seconds(200);  // past the 60 s TTL, within the 240 s
  EXPECT_EQ(area_.Sweep(), 0);
  ASSERT_TRUE((*up)->Append("").ok());  // a keep-alive
  now_ += absl::Seconds(200);
  ASSERT_TRUE((*up)->Append(std::string(32, 'a')).ok());
  ASSERT_TRUE((*up)->Commit().ok());
  now_ += absl::Seconds(241);
  EXPECT_EQ(area_.Sweep(), 1);  // staged: the TTL again, for its step
  EXPECT_EQ(cancels, 0);
}

TEST_F(StagingAreaTest, AClientsStageExpiresATtlAfterItsTicketWasIssuedThoughBytesKeepComing) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  auto up = area_.BeginStage(kTicket, "demo");
  ASSERT_TRUE(up.ok());
  for (int i = 0; i < 3; ++i) {
    now_ += absl::Seconds(20);
    ASSERT_TRUE((*up)->Append(std::string(8, 'a')).ok());
  }
  now_ += absl::Seconds(1);  // 61 s after the ticket was issued, 1 s after the last byte
  ASSERT_TRUE((*up)->Append(std::string(8, 'a')).ok());
  EXPECT_EQ((*up)->Commit().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(StagingAreaTest, ARefusalNamesWhatTheBlockIs) {
  StagingArea small(16, absl::Seconds(60), [this] { return now_; });
  ExpectedBlock b = Block();
  b.operand = "the block of tensor 'w' for rank 1";
  ASSERT_TRUE(small.Expect(kTicket, b).ok());
  auto up = small.BeginStage(kTicket, "demo");
  ASSERT_EQ(up.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(up.status().message(), HasSubstr("staging the block of tensor 'w' for rank 1 of ticket 01234567..."));
}

TEST_F(StagingAreaTest, SweepCancelsTheStreamsOfExpiredTicketsOnce) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  int stage_cancels = 0;
  auto up = area_.BeginStage(kTicket, "demo", [&] { ++stage_cancels; });
  ASSERT_TRUE(up.ok());
  HostTensor out;
  out.dtype = DType::kF32;
  out.shape = {2};
  out.bytes.assign(8, 'o');
  const std::string out_ticket = "fedcba9876543210fedcba9876543210";
  ASSERT_TRUE(area_.Hold(out_ticket, "demo", out).ok());
  int fetch_cancels = 0;
  auto down = area_.BeginFetch(out_ticket, "demo", [&] { ++fetch_cancels; });
  ASSERT_TRUE(down.ok());
  area_.Sweep();
  EXPECT_EQ(stage_cancels + fetch_cancels, 0);  // not expired yet
  now_ += absl::Seconds(61);
  EXPECT_EQ(area_.Sweep(), 2);
  EXPECT_EQ(stage_cancels, 1);
  EXPECT_EQ(fetch_cancels, 1);
  area_.Sweep();
  EXPECT_EQ(stage_cancels + fetch_cancels, 2);  // once each
  up->reset();
  down->reset();
  EXPECT_EQ(area_.held_bytes(), 0);
}

TEST_F(StagingAreaTest, AStreamThatEndedIsNeverCancelled) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  int cancels = 0;
  {
    auto up = area_.BeginStage(kTicket, "demo", [&] { ++cancels; });
    ASSERT_TRUE(up.ok());
    now_ += absl::Seconds(61);
    // Dropped on access while the stream is open, then the stream ends before a sweep.
    EXPECT_EQ(area_.BeginStage(kTicket, "demo").status().code(), absl::StatusCode::kNotFound);
  }
  area_.Sweep();
  EXPECT_EQ(cancels, 0);
  EXPECT_EQ(area_.held_bytes(), 0);
}

TEST_F(StagingAreaTest, ACopyToHoldIsMadeOnlyOnceItsBytesFit) {
  int made = 0;
  auto copy = [&]() -> absl::StatusOr<std::shared_ptr<const HostTensor>> {
    ++made;
    auto t = std::make_shared<HostTensor>();
    t->dtype = DType::kF32;
    t->shape = {2};
    t->bytes.assign(8, 'c');
    return t;
  };
  absl::Status over = area_.HoldMade(kTicket, "demo", 2048, copy);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("--staging_budget"));
  EXPECT_EQ(made, 0);
  EXPECT_EQ(area_.held_bytes(), 0);
  ASSERT_TRUE(area_.HoldMade(kTicket, "demo", 8, copy).ok());
  EXPECT_EQ(made, 1);
  EXPECT_EQ(area_.held_bytes(), 8);
  const std::string other = "fedcba9876543210fedcba9876543210";
  absl::Status failed =
      area_.HoldMade(other, "demo", 8, [] {
        return absl::StatusOr<std::shared_ptr<const HostTensor>>(absl::InternalError("no copy"));
      });
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(area_.held_bytes(), 8);  // the failed copy's reservation is freed
  auto fetch = area_.BeginFetch(kTicket, "demo");
  ASSERT_TRUE(fetch.ok()) << fetch.status();
  EXPECT_EQ((*fetch)->block().bytes, std::string(8, 'c'));
}

TEST_F(StagingAreaTest, DiscardDuringAnUploadEndsItsStreamAtTheNextSweep) {
  ASSERT_TRUE(area_.Expect(kTicket, Block()).ok());
  int cancels = 0;
  auto up = area_.BeginStage(kTicket, "demo", [&] { ++cancels; });
  ASSERT_TRUE(up.ok());
  ASSERT_TRUE((*up)->Append(std::string(32, 'a')).ok());
  area_.Discard(kTicket);  // the step that named it failed while the block was arriving
  area_.Sweep();
  EXPECT_EQ(cancels, 1);
  auto committed = (*up)->Commit();
  EXPECT_EQ(committed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(committed.status().message(), HasSubstr("dropped while it was being staged"));
  up->reset();
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_EQ(area_.Claim(kTicket, DType::kF32, {2, 4}, "lhs").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Stage(kTicket, std::string(32, 'a')).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(StagingAreaTest, DiscardFreesAHeldOutputAndEndsItsFetch) {
  HostTensor out;
  out.dtype = DType::kF32;
  out.shape = {2, 2};
  out.bytes.assign(16, 'o');
  ASSERT_TRUE(area_.Hold(kTicket, "demo", out).ok());
  const std::string other = "fedcba9876543210fedcba9876543210";
  ASSERT_TRUE(area_.Hold(other, "demo", out).ok());
  int cancels = 0;
  auto fetch = area_.BeginFetch(other, "demo", [&] { ++cancels; });
  ASSERT_TRUE(fetch.ok());
  EXPECT_EQ(area_.held_bytes(), 32);
  area_.Discard(kTicket);  // its request failed on another rank
  area_.Discard(other);
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_EQ(area_.held_bytes_of("demo"), 0);
  area_.Sweep();
  EXPECT_EQ(cancels, 1);
  EXPECT_EQ((*fetch)->block().bytes, std::string(16, 'o'));  // the stream's copy stays valid until it ends
  fetch->reset();
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_EQ(area_.BeginFetch(kTicket, "demo").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(StagingAreaTest, DiscardBeforeTheHoldRefusesIt) {
  area_.Discard(kTicket);  // the coordinator gave up the request while its step still ran
  HostTensor out;
  out.dtype = DType::kF32;
  out.shape = {2, 2};
  out.bytes.assign(16, 'o');
  absl::Status held = area_.Hold(kTicket, "demo", out);
  EXPECT_EQ(held.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(held.message(), HasSubstr("dropped"));
  EXPECT_EQ(area_.held_bytes(), 0);
  now_ += absl::Seconds(61);
  EXPECT_EQ(area_.Sweep(), 1);  // the mark goes with the TTL
  EXPECT_EQ(area_.tickets(), 0u);
}

TEST(StagingAreaTenantTest, ATenantHoldsAtMostItsShare) {
  absl::Time now = absl::FromUnixSeconds(1000);
  StagingArea area(100, absl::Seconds(60), [&] { return now; }, /*tenant_limit_bytes=*/50);
  area.set_worker_name("the worker at 127.0.0.1:9");
  const std::string a1(32, '1'), a2(32, '2'), b1(32, '3');
  ASSERT_TRUE(area.Expect(a1, Block("team-a", {2, 4})).ok());  // 32 bytes each
  ASSERT_TRUE(area.Expect(a2, Block("team-a", {2, 4})).ok());
  ASSERT_TRUE(area.Expect(b1, Block("team-b", {2, 4})).ok());
  auto first = area.BeginStage(a1, "team-a");
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = area.BeginStage(a2, "team-a");
  ASSERT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  for (const char* part : {"tenant 'team-a'", "holds 32 bytes", "asks 32", "limit there is 50",
                           "127.0.0.1:9", "--staging_tenant_share"}) {
    EXPECT_THAT(second.status().message(), HasSubstr(part));
  }
  auto other = area.BeginStage(b1, "team-b");  // another tenant's share is its own
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(area.held_bytes_of("team-a"), 32);
  EXPECT_EQ(area.held_bytes_of("team-b"), 32);
  first->reset();  // a stream that ends unfinished gives its share back
  EXPECT_EQ(area.held_bytes_of("team-a"), 0);
  EXPECT_TRUE(area.BeginStage(a2, "team-a").ok());
}

TEST(StagingAreaTenantTest, TheAnonymousTenantIsBoundedByTheBudgetAlone) {
  StagingArea area(100, absl::Seconds(60), [] { return absl::Now(); }, /*tenant_limit_bytes=*/50);
  const std::string t1(32, '1'), t2(32, '2');
  ASSERT_TRUE(area.Expect(t1, Block("", {2, 4})).ok());
  ASSERT_TRUE(area.Expect(t2, Block("", {2, 4})).ok());
  auto first = area.BeginStage(t1, "");
  auto second = area.BeginStage(t2, "");
  EXPECT_TRUE(first.ok());
  EXPECT_TRUE(second.ok());
  EXPECT_EQ(area.held_bytes(), 64);
}

TEST_F(StagingAreaTest, AHeldSharedBlockIsFetchedWithoutACopy) {
  auto shard = std::make_shared<HostTensor>();
  shard->dtype = DType::kF32;
  shard->shape = {4};
  shard->bytes.assign(16, 's');
  std::shared_ptr<const HostTensor> kept = shard;
  ASSERT_TRUE(area_.HoldMade(kTicket, "demo", 16, [&] { return kept; }).ok());
  EXPECT_EQ(area_.held_bytes(), 16);  // shared bytes count against the budget all the same
  auto fetch = area_.BeginFetch(kTicket, "demo");
  ASSERT_TRUE(fetch.ok()) << fetch.status();
  EXPECT_EQ(&(*fetch)->block(), kept.get());
  (*fetch)->Done();
  EXPECT_EQ(area_.held_bytes(), 0);
  EXPECT_EQ(kept->bytes, std::string(16, 's'));  // the owner's bytes are untouched
  EXPECT_EQ(kept.use_count(), 2);  // the area let go of them
}

// The staging area's semantics hold whatever memory keeps the bytes: a
// fake that keeps committed blocks in "device" memory and counts them.
class StagingMemoryTest : public ::testing::Test {
 protected:
  StagingMemoryTest() {
    auto memory = std::make_unique<FakeStagingMemory>();
    fake_ = memory->state();
    area_ = std::make_unique<StagingArea>(1024, absl::Seconds(60), [this] { return now_; }, -1, std::move(memory));
    area_->set_worker_name("worker-7:53007");
  }

  absl::Status Stage(const std::string& ticket, const std::string& data) {
    auto up = area_->BeginStage(ticket, "demo");
    if (!up.ok()) return up.status();
    if (auto s = (*up)->Append(data); !s.ok()) return s;
    return (*up)->Commit().status();
  }

  absl::Time now_ = absl::FromUnixSeconds(1000);
  std::shared_ptr<FakeStagingMemory::State> fake_;
  std::unique_ptr<StagingArea> area_;
};

TEST_F(StagingMemoryTest, ACommittedBlockIsClaimedWhereTheMemoryKeptIt) {
  ExpectedBlock block = Block();
  block.gemm_operand = true;
  ASSERT_TRUE(area_->Expect(kTicket, block).ok());
  auto up = area_->BeginStage(kTicket, "demo");
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_EQ(fake_->begun.size(), 1u);  // the memory learns the block before its bytes
  EXPECT_TRUE(fake_->begun[0].gemm_operand);
  EXPECT_EQ(fake_->begun[0].shape, (std::vector<int64_t>{2, 4}));
  ASSERT_TRUE((*up)->Append(std::string(12, 'a')).ok());
  ASSERT_TRUE((*up)->Append(std::string(20, 'b')).ok());
  ASSERT_TRUE((*up)->Commit().ok());
  up->reset();
  EXPECT_EQ(fake_->appends, (std::vector<std::string>{std::string(12, 'a'), std::string(20, 'b')}));
  EXPECT_EQ(fake_->live_blocks, 1);
  EXPECT_EQ(area_->held_bytes(), 32);

  // Claim gives host bytes only: a device block stays for ClaimBlock.
  auto host = area_->Claim(kTicket, DType::kF32, {2, 4}, "lhs");
  EXPECT_EQ(host.status().code(), absl::StatusCode::kInternal) << host.status();
  EXPECT_EQ(area_->held_bytes(), 32);
  // Claim's checks come first, as they do for host blocks.
  EXPECT_EQ(area_->ClaimBlock(kTicket, DType::kF32, {4, 2}, "lhs").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto claimed = area_->ClaimBlock(kTicket, DType::kF32, {2, 4}, "lhs");
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  ASSERT_NE(claimed->device, nullptr);
  EXPECT_EQ(std::string(static_cast<const char*>(claimed->device->data()), 32),
            std::string(12, 'a') + std::string(20, 'b'));
  EXPECT_EQ(claimed->tensor.dtype, DType::kF32);
  EXPECT_EQ(claimed->tensor.shape, (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(claimed->tensor.bytes.empty());  // a header: the bytes are the device's
  EXPECT_EQ(area_->held_bytes(), 0);  // the step owns them now
  EXPECT_EQ(fake_->live_blocks, 1);
  claimed->device.reset();
  EXPECT_EQ(fake_->live_blocks, 0);
  EXPECT_EQ(area_->ClaimBlock(kTicket, DType::kF32, {2, 4}, "lhs").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(StagingMemoryTest, AnUploadDestroyedWithoutCommitFreesItsBlock) {
  ASSERT_TRUE(area_->Expect(kTicket, Block()).ok());
  {
    auto up = area_->BeginStage(kTicket, "demo");
    ASSERT_TRUE(up.ok()) << up.status();
    ASSERT_TRUE((*up)->Append(std::string(16, 'x')).ok());
    EXPECT_EQ(fake_->live_blocks, 1);
  }
  EXPECT_EQ(fake_->live_blocks, 0);
  EXPECT_EQ(area_->held_bytes(), 0);
  EXPECT_TRUE(Stage(kTicket, std::string(32, 'y')).ok());  // staged again, into a new block
  EXPECT_EQ(fake_->live_blocks, 1);
}

TEST_F(StagingMemoryTest, DiscardExpiryAndSweepFreeTheBlocks) {
  const std::string a = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", b = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
                    c = "cccccccccccccccccccccccccccccccc", d = "dddddddddddddddddddddddddddddddd";
  for (const std::string& t : {a, b, c, d}) ASSERT_TRUE(area_->Expect(t, Block()).ok());
  for (const std::string& t : {a, b, c}) ASSERT_TRUE(Stage(t, std::string(32, t[0])).ok());
  auto open = area_->BeginStage(d, "demo");  // still arriving when it is discarded
  ASSERT_TRUE(open.ok());
  ASSERT_TRUE((*open)->Append(std::string(32, 'd')).ok());
  EXPECT_EQ(fake_->live_blocks, 4);
  EXPECT_EQ(area_->held_bytes(), 128);

  area_->Discard(a);
  EXPECT_EQ(fake_->live_blocks, 3);
  EXPECT_EQ(area_->held_bytes(), 96);
  area_->Discard(d);
  EXPECT_EQ((*open)->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  open->reset();
  EXPECT_EQ(fake_->live_blocks, 2);
  EXPECT_EQ(area_->held_bytes(), 64);

  now_ += absl::Seconds(61);  // b and c expired: b found so on access, c by the sweep
  EXPECT_EQ(area_->ClaimBlock(b, DType::kF32, {2, 4}, "lhs").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(fake_->live_blocks, 1);
  EXPECT_GE(area_->Sweep(), 1);
  EXPECT_EQ(fake_->live_blocks, 0);
  EXPECT_EQ(area_->held_bytes(), 0);
}

TEST_F(StagingMemoryTest, TheBudgetCountsBlocksWhereverTheyLive) {
  const std::string big = "bigbigbigbigbigbigbigbigbigbigbi", more = "moremoremoremoremoremoremoremore";
  ASSERT_TRUE(area_->Expect(big, Block("demo", {200})).ok());   // 800 bytes
  ASSERT_TRUE(area_->Expect(more, Block("demo", {100})).ok());  // 400 more: past 1024
  ASSERT_TRUE(Stage(big, std::string(800, 'g')).ok());
  absl::Status over = area_->BeginStage(more, "demo").status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("--staging_budget"));
  EXPECT_EQ(fake_->begun.size(), 1u);  // refused before the memory was asked
  EXPECT_EQ(area_->held_bytes(), 800);
  EXPECT_EQ(fake_->live_blocks, 1);
}

TEST_F(StagingMemoryTest, AMemoryThatCannotTakeABlockNamesTheWorkerAndHoldsNothing) {
  ASSERT_TRUE(area_->Expect(kTicket, Block()).ok());
  fake_->fail_begin = absl::ResourceExhaustedError("no device memory for 32 bytes");
  auto up = area_->BeginStage(kTicket, "demo");
  EXPECT_EQ(up.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(up.status().message(), HasSubstr("worker-7:53007"));
  EXPECT_THAT(up.status().message(), HasSubstr("no device memory for 32 bytes"));
  EXPECT_EQ(area_->held_bytes(), 0);
  fake_->fail_begin = absl::OkStatus();
  EXPECT_TRUE(Stage(kTicket, std::string(32, 'z')).ok());  // the ticket was given back
}

TEST_F(StagingMemoryTest, AFailingAppendReturnsItsStatusAndLeavesNothingHeld) {
  ASSERT_TRUE(area_->Expect(kTicket, Block()).ok());
  fake_->fail_append_at = 1;
  auto up = area_->BeginStage(kTicket, "demo");
  ASSERT_TRUE(up.ok());
  ASSERT_TRUE((*up)->Append(std::string(16, 'p')).ok());
  absl::Status failed = (*up)->Append(std::string(16, 'q'));
  EXPECT_EQ(failed, fake_->append_error);
  EXPECT_EQ(area_->held_bytes(), 0);  // at once, not when the stream ends
  EXPECT_EQ(fake_->live_blocks, 0);
  EXPECT_EQ((*up)->Append(std::string(16, 'q')), fake_->append_error);  // the upload stays failed
  EXPECT_EQ((*up)->Commit().status(), fake_->append_error);
  EXPECT_EQ(fake_->appends.size(), 2u);
  fake_->fail_append_at = -1;
  EXPECT_TRUE(Stage(kTicket, std::string(32, 'r')).ok());  // may be staged again meanwhile
  up->reset();  // and the failed stream ending takes nothing from it
  EXPECT_EQ(area_->held_bytes(), 32);
  EXPECT_EQ(fake_->live_blocks, 1);
}

TEST_F(StagingMemoryTest, AFailingCommitReturnsItsStatusAndLeavesNothingHeld) {
  ASSERT_TRUE(area_->Expect(kTicket, Block()).ok());
  fake_->fail_finish = absl::DeadlineExceededError("the block's copies did not finish");
  auto up = area_->BeginStage(kTicket, "demo");
  ASSERT_TRUE(up.ok());
  ASSERT_TRUE((*up)->Append(std::string(32, 'p')).ok());
  EXPECT_EQ((*up)->Commit().status(), fake_->fail_finish);
  EXPECT_EQ(area_->held_bytes(), 0);
  EXPECT_EQ(fake_->live_blocks, 0);
  EXPECT_EQ(area_->ClaimBlock(kTicket, DType::kF32, {2, 4}, "lhs").status().code(),
            absl::StatusCode::kFailedPrecondition);  // not staged
  up->reset();
  fake_->fail_finish = absl::OkStatus();
  EXPECT_TRUE(Stage(kTicket, std::string(32, 'r')).ok());
}

TEST_F(StagingMemoryTest, AnOutputIsHeldInTheMemorysHostBlockAndFreedOnceFetched) {
  const std::vector<int64_t> shape = {2, 2};
  ASSERT_TRUE(area_->HoldOutput(kTicket, "demo", DType::kF32, shape, [](char* dst) {
                  std::memset(dst, 'o', 16);
                  return absl::OkStatus();
                }).ok());
  EXPECT_EQ(fake_->live_outputs, 1);
  EXPECT_EQ(area_->held_bytes(), 16);
  auto fetch = area_->BeginFetch(kTicket, "demo");
  ASSERT_TRUE(fetch.ok()) << fetch.status();
  EXPECT_EQ((*fetch)->bytes(), std::string(16, 'o'));
  EXPECT_EQ((*fetch)->block().shape, shape);
  (*fetch)->Done();
  EXPECT_EQ(area_->held_bytes(), 0);
  fetch->reset();
  EXPECT_EQ(fake_->live_outputs, 0);
  EXPECT_EQ(area_->BeginFetch(kTicket, "demo").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(StagingMemoryTest, AnOutputThatFailsOrDoesNotFitHoldsNothing) {
  const std::string other = "fedcba9876543210fedcba9876543210";
  absl::Status failed = area_->HoldOutput(kTicket, "demo", DType::kF32, {4}, [](char*) {
    return absl::InternalError("download failed");
  });
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(area_->held_bytes(), 0);
  EXPECT_EQ(fake_->live_outputs, 0);
  EXPECT_EQ(area_->BeginFetch(kTicket, "demo").status().code(), absl::StatusCode::kNotFound);

  bool filled = false;
  absl::Status over = area_->HoldOutput(other, "demo", DType::kF32, {300}, [&](char*) {  // 1200 bytes
    filled = true;
    return absl::OkStatus();
  });
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("out_staged"));
  EXPECT_THAT(over.message(), HasSubstr("--staging_budget"));
  EXPECT_FALSE(filled);
  EXPECT_EQ(fake_->live_outputs, 0);

  fake_->fail_output = absl::ResourceExhaustedError("no host memory");
  EXPECT_EQ(area_->HoldOutput(other, "demo", DType::kF32, {4}, [](char*) { return absl::OkStatus(); }).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(area_->held_bytes(), 0);
}

}  // namespace
}  // namespace shardgemm
