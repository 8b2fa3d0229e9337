#include "worker/staging_memory.h"

#include <utility>

#include "platform/huge_pages.h"

namespace shardgemm {
namespace {

class HostWriter : public StagingMemory::Writer {
 public:
  explicit HostWriter(int64_t bytes) : expected_(bytes) {}
  absl::Status Append(absl::string_view data) override {
    if (bytes_.empty() && !data.empty()) {  // the whole block at once, filled as the stream arrives
      bytes_.reserve(static_cast<size_t>(expected_));
      platform::AdviseHugePages(bytes_.data(), bytes_.capacity());
    }
    bytes_.append(data.data(), data.size());
    return absl::OkStatus();
  }
  absl::StatusOr<StagedBytes> Finish() override {
    StagedBytes out;
    out.host = std::move(bytes_);
    return out;
  }

 private:
  const int64_t expected_;
  std::string bytes_;
};

class HostStagingMemory : public StagingMemory {
 public:
  absl::StatusOr<std::unique_ptr<Writer>> BeginBlock(const ExpectedBlock&, int64_t bytes) override {
    return std::unique_ptr<Writer>(new HostWriter(bytes));
  }
  absl::StatusOr<std::shared_ptr<HostTensor>> OutputBlock(DType dtype, const std::vector<int64_t>& shape,
                                                          int64_t bytes) override {
    auto t = std::make_shared<HostTensor>();
    t->dtype = dtype;
    t->shape = shape;
    t->bytes.resize(static_cast<size_t>(bytes));
    return t;
  }
};

}  // namespace

std::unique_ptr<StagingMemory> MakeHostStagingMemory() { return std::make_unique<HostStagingMemory>(); }

}  // namespace shardgemm
