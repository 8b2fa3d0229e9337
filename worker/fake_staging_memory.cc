#include "worker/fake_staging_memory.h"

#include <utility>

namespace shardgemm {
namespace {

class FakeWriter : public StagingMemory::Writer {
 public:
  FakeWriter(std::shared_ptr<FakeStagingMemory::State> state, int64_t bytes) : state_(std::move(state)) {
    ++state_->live_blocks;
    bytes_.reserve(static_cast<size_t>(bytes));
  }
  ~FakeWriter() override {
    if (!finished_) --state_->live_blocks;
  }
  absl::Status Append(absl::string_view data) override {
    state_->appends.emplace_back(data);
    if (state_->fail_append_at == static_cast<int>(state_->appends.size()) - 1) return state_->append_error;
    bytes_.append(data.data(), data.size());
    return absl::OkStatus();
  }
  absl::StatusOr<StagedBytes> Finish() override {
    if (!state_->fail_finish.ok()) return state_->fail_finish;
    finished_ = true;
    StagedBytes out;
    if (state_->on_device) {  // the block's count moves to its buffer
      out.device = std::make_shared<FakeStagingMemory::Buffer>(state_, std::move(bytes_));
      return out;
    }
    --state_->live_blocks;
    out.host = std::move(bytes_);
    return out;
  }

 private:
  std::shared_ptr<FakeStagingMemory::State> state_;
  std::string bytes_;
  bool finished_ = false;
};

}  // namespace

FakeStagingMemory::FakeStagingMemory(bool on_device) : state_(std::make_shared<State>()) {
  state_->on_device = on_device;
}

FakeStagingMemory::Buffer::Buffer(std::shared_ptr<State> state, std::string bytes)
    : state_(std::move(state)), bytes_(std::move(bytes)) {}

FakeStagingMemory::Buffer::~Buffer() { --state_->live_blocks; }

absl::StatusOr<std::unique_ptr<StagingMemory::Writer>> FakeStagingMemory::BeginBlock(const ExpectedBlock& block,
                                                                                     int64_t bytes) {
  state_->begun.push_back(block);
  if (!state_->fail_begin.ok()) return state_->fail_begin;
  return std::unique_ptr<Writer>(new FakeWriter(state_, bytes));
}

absl::StatusOr<std::shared_ptr<HostTensor>> FakeStagingMemory::OutputBlock(DType dtype,
                                                                           const std::vector<int64_t>& shape,
                                                                           int64_t bytes) {
  if (!state_->fail_output.ok()) return state_->fail_output;
  auto* t = new HostTensor;
  t->dtype = dtype;
  t->shape = shape;
  t->bytes.assign(static_cast<size_t>(bytes), '\xee');  // not zeros: the caller writes every byte
  ++state_->live_outputs;
  std::shared_ptr<State> state = state_;
  return std::shared_ptr<HostTensor>(t, [state](HostTensor* p) {
    --state->live_outputs;
    delete p;
  });
}

}  // namespace shardgemm
