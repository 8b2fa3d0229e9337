#include "server/dispatcher.h"

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "platform/local_socket.h"
#include "server/fake_worker_channel.h"

namespace shardgemm {
namespace {

class DispatcherTest : public ::testing::Test {
 protected:
  // A dispatcher over `mesh` whose channels are fakes, by address.
  std::unique_ptr<Dispatcher> Make(const std::string& mesh, bool prefer_local_socket = false) {
    return std::make_unique<Dispatcher>(
        *planner::ParseMesh(mesh, ""),
        [this](const std::string& address) {
          auto it = fakes_.find(address);
          if (it == fakes_.end()) it = fakes_.emplace(address, FakeWorkerChannel()).first;
          return std::make_unique<FakeWorkerChannel>(it->second);
        },
        absl::Milliseconds(100), prefer_local_socket);
  }
  static v1::RegisterRequest At(const std::string& address) {
    v1::RegisterRequest r;
    r.set_address(address);
    return r;
  }
  static std::vector<v1::Step> DeleteSteps(int n) {
    std::vector<v1::Step> steps(n);
    for (v1::Step& s : steps) s.mutable_delete_shard()->set_name("nothing");
    return steps;
  }
  std::map<std::string, FakeWorkerChannel> fakes_;
};

TEST_F(DispatcherTest, WorkersJoinInOrderAndGetTheirRankBack) {
  auto d = Make("dp=2,ep=2");
  EXPECT_EQ(d->CheckComplete().code(), absl::StatusCode::kUnavailable);
  for (int i = 0; i < 4; ++i) {
    auto j = d->Join(At("w" + std::to_string(i)));
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_EQ(j->rank, i);
  }
  EXPECT_TRUE(d->Complete());
  EXPECT_EQ(d->Join(At("w9")).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(d->Join(At("w2"))->rank, 2);
  EXPECT_EQ(d->Join(At("")).status().code(), absl::StatusCode::kInvalidArgument);
  const auto workers = d->Workers();
  ASSERT_EQ(workers.size(), 4u);
  EXPECT_EQ(std::vector<int64_t>(workers[3].coords().begin(), workers[3].coords().end()),
            std::vector<int64_t>({1, 1}));
}

// A worker on this host is called on its Unix socket, and only when the
// socket it describes is that very socket here (boot id, inode, owner);
// otherwise, or with the preference off, at its TCP address.
TEST_F(DispatcherTest, AWorkerOnThisHostIsCalledOnItsUnixSocketOnlyWhenItIsThatSocket) {
  auto dir = platform::PrivateSocketDir::Create("/tmp", "w.sock");
  ASSERT_TRUE(dir.ok()) << dir.status();
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, dir->socket_path().c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  auto inode = platform::SocketInode(dir->socket_path());
  ASSERT_TRUE(inode.ok()) << inode.status();
  auto described = [&](const std::string& address, const std::string& boot_id, uint64_t ino) {
    v1::RegisterRequest r = At(address);
    r.mutable_local_socket()->set_path(dir->socket_path());
    r.mutable_local_socket()->set_boot_id(boot_id);
    r.mutable_local_socket()->set_inode(ino);
    return r;
  };
  auto d = Make("dp=4", /*prefer_local_socket=*/true);
  ASSERT_TRUE(d->Join(described("same", platform::BootId(), *inode)).ok());
  ASSERT_TRUE(d->Join(described("other-host", "00000000-0000-0000-0000-000000000000", *inode)).ok());
  ASSERT_TRUE(d->Join(described("other-file", platform::BootId(), *inode + 1)).ok());
  ASSERT_TRUE(d->Join(At("tcp-only")).ok());
  EXPECT_EQ(fakes_.count("unix:" + dir->socket_path()), 1u);
  EXPECT_EQ(fakes_.count("same"), 0u);
  EXPECT_EQ(fakes_.count("other-host"), 1u);
  EXPECT_EQ(fakes_.count("other-file"), 1u);
  EXPECT_EQ(fakes_.count("tcp-only"), 1u);
  const auto workers = d->Workers();
  ASSERT_EQ(workers.size(), 4u);
  EXPECT_EQ(workers[0].hop(), v1::WORKER_HOP_UNIX_SOCKET);
  EXPECT_EQ(workers[0].address(), "same");  // the address stays the worker's identity for a restart
  for (int r = 1; r < 4; ++r) EXPECT_EQ(workers[r].hop(), v1::WORKER_HOP_TCP) << r;

  fakes_.clear();
  auto off = Make("dp=1", /*prefer_local_socket=*/false);
  ASSERT_TRUE(off->Join(described("same", platform::BootId(), *inode)).ok());
  EXPECT_EQ(fakes_.count("same"), 1u);
  EXPECT_EQ(off->Workers()[0].hop(), v1::WORKER_HOP_TCP);
  close(fd);
}

TEST_F(DispatcherTest, AWorkerThatFailsFailsTheDispatchAtOnceWithoutWaitingForItsPeers) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("alive")).ok());
  ASSERT_TRUE(d->Join(At("dead")).ok());
  fakes_.at("alive").SetNeverAnswer(true);  // stuck in a collective with the dead one
  fakes_.at("dead").SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> {
    return absl::UnavailableError("connection refused");
  });
  const absl::Time start = absl::Now();
  auto r = d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(30));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("worker 1"), std::string::npos) << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "not at the 30 s deadline";
  fakes_.at("dead").SetHandler(nullptr);
  fakes_.at("alive").SetNeverAnswer(false);
  fakes_.at("alive").AnswerHeld();
}

// A worker marked down while a step runs is what the step's failure names,
// not the peer whose communicator its death revoked (that peer's error names
// only itself).
TEST_F(DispatcherTest, AStepsFailureNamesTheRankThatWentDownDuringIt) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("dead")).ok());
  ASSERT_TRUE(d->Join(At("peer")).ok());
  fakes_.at("dead").SetNeverAnswer(true);
  fakes_.at("peer").SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> {
    return absl::UnavailableError("rendezvous get failed: its communicator was revoked");
  });
  fakes_.at("peer").SetAnswerDelay(absl::Milliseconds(300));
  absl::StatusOr<std::vector<v1::StepResult>> r = absl::UnknownError("not dispatched");
  absl::Notification done;
  std::thread dispatch([&] {
    r = d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(30));
    done.Notify();
  });
  absl::SleepFor(absl::Milliseconds(50));
  d->MarkDown(0, absl::UnavailableError("missed 2 heartbeats"), d->Channels()[0].get());
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  dispatch.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("worker 0 is down (missed 2 heartbeats)"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("worker 1: rendezvous"), std::string::npos) << r.status();
  fakes_.at("dead").SetNeverAnswer(false);
  fakes_.at("dead").AnswerHeld();
}

// A client that goes away is not waited for: Dispatch returns CANCELLED
// within a poll of the cancellation, and the next dispatch is not held
// behind the abandoned one's numbers.
TEST_F(DispatcherTest, ACancelledCallerIsNotWaitedFor) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  for (const char* w : {"a", "b"}) {
    fakes_.at(w).SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  }
  fakes_.at("b").SetNeverAnswer(true);
  std::atomic<bool> gone{false};
  std::thread client([&] {
    absl::SleepFor(absl::Milliseconds(50));
    gone = true;
  });
  const absl::Time start = absl::Now();
  auto r = d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(30), [&] { return gone.load(); });
  client.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "not at the 30 s deadline";
  fakes_.at("b").SetNeverAnswer(false);
  fakes_.at("b").AnswerHeld();
  auto next = d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5), [] { return false; });
  EXPECT_TRUE(next.ok()) << next.status();
  for (const char* w : {"a", "b"}) fakes_.at(w).SetHandler(nullptr);
}

// Shutdown: AbandonAll answers the dispatch waiting, and every later one at
// once with the same status, none of its steps sent (a call that starts
// while the coordinator shuts down is not run on workers about to lose it).
TEST_F(DispatcherTest, AfterAbandonAllADispatchIsAnsweredAtOnceAndSendsNothing) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  for (const char* w : {"a", "b"}) {
    fakes_.at(w).SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  }
  fakes_.at("b").SetNeverAnswer(true);
  absl::StatusOr<std::vector<v1::StepResult>> waiting = absl::UnknownError("not dispatched");
  absl::Notification answered;
  std::thread dispatch([&] {
    waiting = d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(30));
    answered.Notify();
  });
  ASSERT_TRUE(fakes_.at("b").AwaitHeld(1, absl::Seconds(10)));
  d->AbandonAll(absl::UnavailableError("the coordinator is shutting down"));
  EXPECT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  dispatch.join();
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kUnavailable) << waiting.status();
  const int sent_a = fakes_.at("a").num_steps();
  const int sent_b = fakes_.at("b").num_steps();
  const absl::Time start = absl::Now();
  auto later = d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "not at the 30 s deadline";
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable) << later.status();
  EXPECT_NE(later.status().message().find("shutting down"), std::string::npos) << later.status();
  absl::Notification async_answered;
  d->DispatchAsync(DeleteSteps(2), absl::Now() + absl::Seconds(30),
                   [&](absl::StatusOr<std::vector<v1::StepResult>> r) {
                     EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
                     async_answered.Notify();
                   });
  EXPECT_TRUE(async_answered.HasBeenNotified()) << "answered inline";
  EXPECT_EQ(fakes_.at("a").num_steps(), sent_a);
  EXPECT_EQ(fakes_.at("b").num_steps(), sent_b);
  fakes_.at("b").SetNeverAnswer(false);
  fakes_.at("b").AnswerHeld();
  for (const char* w : {"a", "b"}) fakes_.at(w).SetHandler(nullptr);
}

TEST_F(DispatcherTest, APeersAbortedWaitsForTheWorkerThatFailed) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  fakes_.at("a").SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> {
    return absl::AbortedError("another worker failed this step");
  });
  fakes_.at("b").SetAnswerDelay(absl::Milliseconds(200));
  fakes_.at("b").SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> {
    return absl::ResourceExhaustedError("over the memory budget");
  });
  auto r = d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(30));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << "the cause, not the peer's ABORTED";
  fakes_.at("a").SetHandler(nullptr);
  fakes_.at("b").SetHandler(nullptr);
}

TEST_F(DispatcherTest, WorkersRegisteringAgainGetTheRanksTheyHeldWhateverTheOrder) {
  auto d = Make("dp=3");
  v1::RegisterRequest second = At("was-2");
  second.set_previous_rank(2);
  v1::RegisterRequest zeroth = At("was-0");
  zeroth.set_previous_rank(0);
  EXPECT_EQ(d->Join(second)->rank, 2);
  EXPECT_EQ(d->Join(zeroth)->rank, 0);
  EXPECT_EQ(d->Join(At("fresh"))->rank, 1) << "a fresh worker takes the lowest free rank";
  EXPECT_TRUE(d->Complete());
  v1::RegisterRequest taken = At("also-0");
  taken.set_previous_rank(0);
  EXPECT_EQ(d->Join(taken).status().code(), absl::StatusCode::kResourceExhausted) << "rank 0 is held and answering";
}

TEST_F(DispatcherTest, EveryWorkerGetsTheSameNumberAndNumbersIncrease) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5)).status().code() ==
                                          absl::StatusCode::kNotFound);  // the fake holds no such shard
  d->DispatchDetached(DeleteSteps(2), absl::Now() + absl::Seconds(5));
  std::vector<uint64_t> a, b;
  for (const auto& s : fakes_.at("a").steps()) a.push_back(s.sequence());
  for (const auto& s : fakes_.at("b").steps()) b.push_back(s.sequence());
  EXPECT_EQ(a, std::vector<uint64_t>({1, 2, 3, 4}));
  EXPECT_EQ(a, b);
  // A worker that rejoins starts where the order is now.
  EXPECT_EQ(d->Join(At("a"))->next_sequence, 5u);
}

TEST_F(DispatcherTest, ReleasesRideOnTheNextStepOfEveryWorker) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  d->Release("w@1");
  d->Release("y@4");
  EXPECT_EQ(d->pending_releases(), 2u);
  for (const char* w : {"a", "b"}) {
    fakes_.at(w).SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  }
  ASSERT_TRUE(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(d->pending_releases(), 0u);
  for (const char* w : {"a", "b"}) {
    const auto steps = fakes_.at(w).steps();
    ASSERT_EQ(steps.size(), 1u);
    EXPECT_EQ(std::vector<std::string>(steps[0].release_shards().begin(), steps[0].release_shards().end()),
              std::vector<std::string>({"w@1", "y@4"}));
  }
  // Sent once: the step after carries none.
  ASSERT_TRUE(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(fakes_.at("a").steps()[1].release_shards_size(), 0);
}

TEST_F(DispatcherTest, FailingWorkersStatusWinsOverItsPeersAborted) {
  auto d = Make("dp=3");
  for (const char* w : {"a", "b", "c"}) ASSERT_TRUE(d->Join(At(w)).ok());
  fakes_.at("a").SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return absl::AbortedError("peer"); });
  fakes_.at("b").SetHandler(
      [](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return absl::ResourceExhaustedError("budget"); });
  fakes_.at("c").SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return absl::AbortedError("peer"); });
  auto r = d->Dispatch(DeleteSteps(3), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(r.status().message().rfind("worker 1: ", 0), 0u) << r.status();
}

TEST_F(DispatcherTest, WorkerThatNeverAnswersIsDeadlineExceededInTime) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  fakes_.at("a").SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  fakes_.at("b").SetNeverAnswer(true);
  const absl::Time start = absl::Now();
  auto r = d->Dispatch(DeleteSteps(2), start + absl::Milliseconds(150));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_EQ(r.status().message().rfind("worker 1: ", 0), 0u) << r.status();
  EXPECT_LT(took, absl::Milliseconds(150 + 100 + 200));  // deadline + grace + scheduling slack
}

TEST_F(DispatcherTest, StepsForTheWrongNumberOfWorkersAreRefused) {
  auto d = Make("dp=2");
  EXPECT_EQ(d->Dispatch(DeleteSteps(3), absl::Now() + absl::Seconds(1)).status().code(), absl::StatusCode::kInternal);
}

// The asynchronous dispatch: its callback runs exactly once, with every
// worker's answer, on the thread of the last answer; nothing waits.
TEST_F(DispatcherTest, AnAsynchronousDispatchCallsBackOnceWithEveryAnswer) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  for (const char* w : {"a", "b"}) {
    fakes_.at(w).SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  }
  fakes_.at("b").SetNeverAnswer(true);
  absl::Mutex mu;
  int calls = 0;
  absl::StatusOr<std::vector<v1::StepResult>> got = absl::UnknownError("not yet");
  d->DispatchAsync(DeleteSteps(2), absl::Now() + absl::Seconds(30),
                   [&](absl::StatusOr<std::vector<v1::StepResult>> r) {
                     absl::MutexLock lock(&mu);
                     ++calls;
                     got = std::move(r);
                   });
  ASSERT_TRUE(fakes_.at("b").AwaitHeld(1, absl::Seconds(5)));
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(calls, 0) << "one worker has not answered";
  }
  fakes_.at("b").SetNeverAnswer(false);
  fakes_.at("b").AnswerHeld();
  absl::MutexLock lock(&mu);
  auto answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return calls > 0; };
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&answered), absl::Seconds(5)));
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->size(), 2u);
}

// A worker that registers again replaces its channel; the old one fails the
// steps it still holds as it goes (as a step socket's does), and those
// answers take the dispatcher's locks: it goes after Join lets them go.
TEST_F(DispatcherTest, AChannelReplacedByARejoinFailsItsStepsOutsideTheDispatchersLocks) {
  int connects = 0;
  FakeWorkerChannel first;
  first.SetNeverAnswer(true);
  FakeWorkerChannel watch = first;  // sees what the dispatcher's handle received
  auto d = std::make_unique<Dispatcher>(
      *planner::ParseMesh("dp=1", ""),
      [&](const std::string&) -> std::unique_ptr<WorkerChannel> {
        return std::make_unique<FakeWorkerChannel>(connects++ == 0 ? first : FakeWorkerChannel());
      },
      absl::Milliseconds(100), false);
  ASSERT_TRUE(d->Join(At("a")).ok());
  absl::Notification answered;
  absl::Status got;
  d->DispatchAsync(DeleteSteps(1), absl::Now() + absl::Seconds(30), [&](absl::StatusOr<std::vector<v1::StepResult>> r) {
    got = r.status();
    answered.Notify();
  });
  ASSERT_TRUE(watch.AwaitHeld(1, absl::Seconds(5)));
  // The dispatcher now holds the held step's fake alone.
  watch = FakeWorkerChannel();
  first = FakeWorkerChannel();
  auto rejoined = d->Join(At("a"));  // before the fix: the old channel's CANCELLED deadlocked here
  ASSERT_TRUE(rejoined.ok()) << rejoined.status();
  EXPECT_TRUE(rejoined->rejoined);
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(got.code(), absl::StatusCode::kCancelled) << got;
}

// A channel that never reports back (a fake: gRPC's report by the deadline)
// cannot hold an asynchronous dispatch: the watchdog ends it at the
// deadline plus the grace (100 ms here), DEADLINE_EXCEEDED naming the worker.
TEST_F(DispatcherTest, AWatchdogEndsAnAsynchronousDispatchNoChannelAnswers) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  for (const char* w : {"a", "b"}) {
    fakes_.at(w).SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  }
  fakes_.at("b").SetNeverAnswer(true);
  absl::Notification done;
  absl::Status status;
  const absl::Time start = absl::Now();
  d->DispatchAsync(DeleteSteps(2), start + absl::Milliseconds(100),
                   [&](absl::StatusOr<std::vector<v1::StepResult>> r) {
                     status = r.status();
                     done.Notify();
                   });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("worker 1"), std::string::npos) << status;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  fakes_.at("b").SetNeverAnswer(false);
  fakes_.at("b").AnswerHeld();
}

// Cancel ends the dispatch at once with CANCELLED; the late answer is
// dropped (the callback is not called again), and the next dispatch runs.
TEST_F(DispatcherTest, ACancelledAsynchronousDispatchEndsAtOnceAndIgnoresLateAnswers) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  for (const char* w : {"a", "b"}) {
    fakes_.at(w).SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  }
  fakes_.at("b").SetNeverAnswer(true);
  std::atomic<int> calls{0};
  absl::Status status;
  std::vector<v1::Step> steps = DeleteSteps(2);
  for (v1::Step& step : steps) step.set_session("session-a");
  auto pending = d->DispatchAsync(std::move(steps), absl::Now() + absl::Seconds(30),
                                  [&](absl::StatusOr<std::vector<v1::StepResult>> r) {
                                    status = r.status();
                                    ++calls;
                                  });
  ASSERT_TRUE(fakes_.at("b").AwaitHeld(1, absl::Seconds(5)));
  EXPECT_EQ(calls.load(), 0);
  pending->Cancel();
  EXPECT_EQ(calls.load(), 1) << "inline, at once";
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  // Every worker hears the step is given up on (one that has not started it drops it).
  for (const char* w : {"a", "b"}) EXPECT_EQ(fakes_.at(w).cancelled().size(), 1u) << w;
  fakes_.at("b").SetNeverAnswer(false);
  fakes_.at("b").AnswerHeld();
  pending->Cancel();
  EXPECT_EQ(calls.load(), 1);
  auto next = d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(d->GetStats().steps_in_flight, 0);
}

// The mesh epoch: stamped on every step, unchanged by a success or an
// agreed failure, advanced (and every worker told) by a failure that may
// leave a collective half done, by a rank newly down and by a rank joining.
TEST_F(DispatcherTest, TheEpochAdvancesOnlyWhereACollectiveMayBeHalfDoneOrTheMembersChange) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  std::vector<uint64_t> heard;
  d->SetEpochListener([&](uint64_t epoch) { heard.push_back(epoch); });
  const uint64_t start = d->epoch();  // the joins advanced it too
  std::map<std::string, size_t> told_before;
  for (const char* w : {"a", "b"}) told_before[w] = fakes_.at(w).epoch_advances().size();
  auto last_epoch = [&](const char* w) { return fakes_.at(w).steps().back().epoch(); };
  for (const char* w : {"a", "b"}) {
    fakes_.at(w).SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  }
  ASSERT_TRUE(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(last_epoch("a"), start);
  EXPECT_EQ(last_epoch("b"), start);
  // One worker's own error, its peer ABORTED at the agreement: every collective completed.
  fakes_.at("a").SetHandler(
      [](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return absl::NotFoundError("no shard"); });
  fakes_.at("b").SetHandler(
      [](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return absl::AbortedError("peer"); });
  EXPECT_EQ(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(d->epoch(), start);
  EXPECT_TRUE(heard.empty());
  EXPECT_EQ(fakes_.at("a").epoch_advances().size(), told_before["a"]);
  // A collective's failure on one worker: the epoch advances, both workers are told why.
  fakes_.at("a").SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  fakes_.at("b").SetHandler(
      [](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return absl::UnavailableError("collective timed out"); });
  const uint64_t failed_at = fakes_.at("a").num_steps() + 1;  // one step per dispatch, numbered from 1
  EXPECT_EQ(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(d->epoch(), start + 1);
  EXPECT_EQ(heard, std::vector<uint64_t>({start + 1}));
  for (const char* w : {"a", "b"}) {
    const auto told = fakes_.at(w).epoch_advances();
    ASSERT_EQ(told.size(), told_before[w] + 1) << w;
    EXPECT_EQ(told.back().epoch(), start + 1);
    EXPECT_EQ(told.back().reason(), v1::EPOCH_STEP_FAILED);
    EXPECT_EQ(told.back().rank(), 1);
    EXPECT_EQ(told.back().sequence(), failed_at);
  }
  fakes_.at("b").SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  ASSERT_TRUE(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(last_epoch("a"), start + 1);
  EXPECT_EQ(last_epoch("b"), start + 1);
  // A rank newly down (once, however many heartbeats it misses), and a worker taking it.
  const auto channels = d->Channels();
  d->MarkDown(1, absl::UnavailableError("refused"), channels[1].get());
  d->MarkDown(1, absl::UnavailableError("refused"), channels[1].get());
  EXPECT_EQ(d->epoch(), start + 2);
  EXPECT_EQ(fakes_.at("a").epoch_advances().back().reason(), v1::EPOCH_RANK_DOWN);
  EXPECT_EQ(fakes_.at("a").epoch_advances().back().rank(), 1);
  ASSERT_EQ(d->Join(At("b-restarted"))->rank, 1);
  EXPECT_EQ(d->epoch(), start + 3);
  EXPECT_EQ(fakes_.at("a").epoch_advances().back().reason(), v1::EPOCH_RANK_JOINED);
  EXPECT_EQ(heard, std::vector<uint64_t>({start + 1, start + 2, start + 3}));
  for (const char* w : {"a", "b"}) fakes_.at(w).SetHandler(nullptr);
}

// A step given up on (expired here) advances the epoch in the same instant
// it stops being live: a worker that skips it, on a later step's
// oldest_live_sequence, learns the new epoch from that step.
TEST_F(DispatcherTest, AStepGivenUpOnAdvancesTheEpochBeforeAnyStepPassesIt) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  for (const char* w : {"a", "b"}) {
    fakes_.at(w).SetHandler([](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return v1::StepResult(); });
  }
  fakes_.at("b").SetNeverAnswer(true);
  const uint64_t start = d->epoch();
  const size_t told_before = fakes_.at("b").epoch_advances().size();
  EXPECT_EQ(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  fakes_.at("b").SetNeverAnswer(false);
  fakes_.at("b").AnswerHeld();
  ASSERT_TRUE(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(5)).ok());
  const auto steps = fakes_.at("a").steps();
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].epoch(), start);
  EXPECT_GT(steps[1].oldest_live_sequence(), steps[0].sequence());
  EXPECT_EQ(steps[1].epoch(), start + 1);
  const auto told = fakes_.at("b").epoch_advances();
  ASSERT_EQ(told.size(), told_before + 1);
  EXPECT_EQ(told.back().reason(), v1::EPOCH_STEP_ABANDONED);
  EXPECT_EQ(told.back().rank(), 1) << "the worker that did not answer";
  for (const char* w : {"a", "b"}) fakes_.at(w).SetHandler(nullptr);
}

// A worker's own failure ends the dispatch before its peers answer; their
// answers decide the epoch: ABORTED (they met it at the agreement) leaves
// it, a collective's failure (one left waiting: a worker that stayed out of
// the collective) advances it. The step stays live until then.
TEST_F(DispatcherTest, AfterAWorkersOwnFailureThePeersAnswersDecideTheEpoch) {
  auto d = Make("dp=2");
  ASSERT_TRUE(d->Join(At("a")).ok());
  ASSERT_TRUE(d->Join(At("b")).ok());
  const uint64_t start = d->epoch();
  fakes_.at("a").SetHandler(
      [](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return absl::ResourceExhaustedError("budget"); });
  fakes_.at("b").SetNeverAnswer(true);
  auto r = d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(30));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(d->GetStats().steps_in_flight, 1) << "live until the peer answers";
  fakes_.at("b").SetHandler(
      [](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return absl::AbortedError("peer"); });
  fakes_.at("b").SetNeverAnswer(false);
  fakes_.at("b").AnswerHeld();
  EXPECT_EQ(d->GetStats().steps_in_flight, 0);
  EXPECT_EQ(d->epoch(), start) << "the peer met the failure at the agreement";
  fakes_.at("b").SetHandler(
      [](const v1::Step&) -> absl::StatusOr<v1::StepResult> { return absl::UnavailableError("collective timed out"); });
  fakes_.at("b").SetNeverAnswer(true);
  EXPECT_EQ(d->Dispatch(DeleteSteps(2), absl::Now() + absl::Seconds(30)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(d->epoch(), start);
  fakes_.at("b").SetNeverAnswer(false);
  fakes_.at("b").AnswerHeld();
  EXPECT_EQ(d->epoch(), start + 1) << "the peer was left in a collective";
  EXPECT_EQ(d->GetStats().steps_in_flight, 0);
  for (const char* w : {"a", "b"}) fakes_.at(w).SetHandler(nullptr);
}

TEST(Cancellation, RunsItsActionOnceAndAtOnceWhenCancelledAlready) {
  Cancellation c;
  int runs = 0;
  c.OnCancel([&] { ++runs; });
  EXPECT_FALSE(c.cancelled());
  c.Cancel();
  c.Cancel();
  EXPECT_TRUE(c.cancelled());
  EXPECT_EQ(runs, 1);
  c.OnCancel([&] { runs += 10; });
  EXPECT_EQ(runs, 11) << "registered after the cancellation: run at once";
  Cancellation cleared;
  cleared.OnCancel([&] { runs += 100; });
  cleared.Clear();
  cleared.Cancel();
  EXPECT_EQ(runs, 11);
}

}  // namespace
}  // namespace shardgemm
