// A staging memory for tests (worker/staging_memory.h): records the blocks
// and bytes it is given, counts what it holds, fails where a test asks, and
// keeps finished blocks in "device" memory (host memory behind a
// DeviceBuffer) unless told to keep them on the host. Single-threaded use.
#ifndef SHARDGEMM_WORKER_FAKE_STAGING_MEMORY_H_
#define SHARDGEMM_WORKER_FAKE_STAGING_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/shard.h"
#include "worker/staging_memory.h"

namespace shardgemm {

class FakeStagingMemory : public StagingMemory {
 public:
  // Shared with the blocks it hands out, so a test reads it after the
  // memory went into a staging area.
  struct State {
    bool on_device = true;  // finished blocks as DeviceBuffers (else in StagedBytes::host)
    std::vector<ExpectedBlock> begun;  // every BeginBlock's block, in order
    std::vector<std::string> appends;  // every Append's bytes, in order
    int live_blocks = 0;   // writers not yet finished or freed, and device blocks not freed
    int live_outputs = 0;  // output blocks not freed
    // Set: the call fails with it. `fail_append_at`: the Append of that
    // index (into `appends`, counting the failing one) fails with `append_error`.
    absl::Status fail_begin, fail_finish, fail_output;
    int fail_append_at = -1;
    absl::Status append_error = absl::DataLossError("fake staging memory: append failed");
  };

  explicit FakeStagingMemory(bool on_device = true);
  std::shared_ptr<State> state() const { return state_; }

  absl::StatusOr<std::unique_ptr<Writer>> BeginBlock(const ExpectedBlock& block, int64_t bytes) override;
  absl::StatusOr<std::shared_ptr<HostTensor>> OutputBlock(DType dtype, const std::vector<int64_t>& shape,
                                                          int64_t bytes) override;

  // Host memory posing as device memory; counted in State::live_blocks.
  class Buffer : public DeviceBuffer {
   public:
    Buffer(std::shared_ptr<State> state, std::string bytes);
    ~Buffer() override;
    void* data() const override { return const_cast<char*>(bytes_.data()); }
    int64_t bytes() const override { return static_cast<int64_t>(bytes_.size()); }

   private:
    std::shared_ptr<State> state_;
    std::string bytes_;
  };

 private:
  std::shared_ptr<State> state_;
};

}  // namespace shardgemm

#endif  // SHARDGEMM_WORKER_FAKE_STAGING_MEMORY_H_
