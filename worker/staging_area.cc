#include "worker/staging_area.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardgemm {

namespace {

// A ticket is a secret: messages name only its first characters.
std::string Named(const std::string& ticket) { return absl::StrCat("ticket ", ticket.substr(0, 8), "..."); }

absl::StatusOr<int64_t> BlockBytes(const ExpectedBlock& block) {
  if (block.dtype == DType::kInvalid) return absl::InvalidArgumentError("dtype: unset");
  int64_t n = DTypeSize(block.dtype);
  for (int64_t d : block.shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("shape: dimension ", d, " is negative"));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return absl::InvalidArgumentError("shape: too large");
    n *= d;
  }
  return n;
}

}  // namespace

StagingArea::StagingArea(int64_t budget_bytes, absl::Duration ttl, Clock now, int64_t tenant_limit_bytes,
                         std::unique_ptr<StagingMemory> memory)
    : budget_bytes_(budget_bytes),
      tenant_limit_bytes_(tenant_limit_bytes),
      ttl_(ttl),
      now_(std::move(now)),
      memory_(memory != nullptr ? std::move(memory) : MakeHostStagingMemory()) {}

void StagingArea::set_worker_name(std::string name) {
  absl::MutexLock lock(&mu_);
  worker_name_ = std::move(name);
}

StagingArea::Entry* StagingArea::Find(const std::string& ticket) {
  auto it = entries_.find(ticket);
  if (it == entries_.end()) return nullptr;
  if (it->second.expires <= now_()) {
    Drop(it);
    return nullptr;
  }
  return &it->second;
}

void StagingArea::Drop(absl::flat_hash_map<std::string, Entry>::iterator it) {
  const State s = it->second.state;
  // A stream being received owns its reservation (it ends it); the others' bytes are the entry's.
  if (s == State::kStaged || s == State::kHeld || s == State::kFetching) Unreserve(it->second.bytes, it->second.block.tenant);
  if ((s == State::kStaging || s == State::kFetching) && it->second.cancel) {
    expired_streams_[it->second.id] = std::move(it->second.cancel);
  }
  entries_.erase(it);  // frees a block's memory (a device staging memory's too)
}

absl::Status StagingArea::Reserve(int64_t bytes, const std::string& tenant, absl::string_view what) {
  if (bytes > budget_bytes_ - held_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " needs ", bytes, " bytes; ", held_bytes_, " of the ",
                                                     budget_bytes_, " of --staging_budget are held on ",
                                                     worker_name_));
  }
  if (!tenant.empty() && tenant_limit_bytes_ >= 0) {
    auto it = held_by_tenant_.find(tenant);
    const int64_t held = it == held_by_tenant_.end() ? 0 : it->second;
    if (bytes > tenant_limit_bytes_ - held) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": tenant '", tenant, "' holds ", held, " bytes staged on ", worker_name_, " and asks ", bytes,
          " more; its limit there is ", tenant_limit_bytes_, " bytes (--staging_tenant_share of the ", budget_bytes_,
          " of --staging_budget)"));
    }
  }
  held_bytes_ += bytes;
  if (!tenant.empty() && bytes > 0) held_by_tenant_[tenant] += bytes;
  return absl::OkStatus();
}

void StagingArea::Unreserve(int64_t bytes, const std::string& tenant) {
  held_bytes_ -= bytes;
  if (tenant.empty() || bytes == 0) return;
  auto it = held_by_tenant_.find(tenant);
  if (it == held_by_tenant_.end()) return;
  it->second -= bytes;
  if (it->second <= 0) held_by_tenant_.erase(it);
}

absl::Status StagingArea::Expect(const std::string& ticket, ExpectedBlock block) {
  auto bytes = BlockBytes(block);
  if (!bytes.ok()) return bytes.status();
  absl::MutexLock lock(&mu_);
  if (Find(ticket) != nullptr) return absl::AlreadyExistsError(absl::StrCat(Named(ticket), " is known already"));
  Entry& e = entries_[ticket];
  e.block = std::move(block);
  e.bytes = *bytes;
  e.expires = now_() + ttl_;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StagingArea::Upload>> StagingArea::BeginStage(const std::string& ticket,
                                                                             const std::string& tenant,
                                                                             CancelStream cancel, StageTtl ttl,
                                                                             absl::Duration idle) {
  ExpectedBlock block;
  std::string worker;
  auto upload = OpenUpload(ticket, tenant, std::move(cancel), ttl, idle, &block, &worker);
  if (!upload.ok()) return upload.status();
  // Outside the lock: a device staging memory allocates device memory here.
  // Failing, the upload goes: its reservation with it, the ticket stays expected.
  auto writer = memory_->BeginBlock(block, (*upload)->expected_bytes());
  if (!writer.ok()) {
    return absl::Status(writer.status().code(), absl::StrCat("staging ", block.operand, " of ", Named(ticket),
                                                             " on ", worker, ": ", writer.status().message()));
  }
  (*upload)->writer_ = *std::move(writer);
  return upload;
}

absl::StatusOr<std::unique_ptr<StagingArea::Upload>> StagingArea::OpenUpload(const std::string& ticket,
                                                                             const std::string& tenant,
                                                                             CancelStream cancel, StageTtl ttl,
                                                                             absl::Duration idle,
                                                                             ExpectedBlock* block,
                                                                             std::string* worker) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(ticket);
  if (e == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "ticket: ", Named(ticket), " is unknown on this worker or expired (--staged_block_ttl of ",
        absl::FormatDuration(ttl_), "); ask the coordinator for a new transfer plan"));
  }
  if (e->block.tenant != tenant) {
    return absl::PermissionDeniedError(absl::StrCat("ticket: ", Named(ticket), " was issued to another tenant"));
  }
  switch (e->state) {
    case State::kExpected:
      break;
    case State::kStaging:
      return absl::FailedPreconditionError(absl::StrCat("ticket: ", Named(ticket), " is being staged by another stream"));
    case State::kStaged:
      return absl::FailedPreconditionError(absl::StrCat("ticket: ", Named(ticket), " was staged already"));
    case State::kUsed:
      return absl::FailedPreconditionError(absl::StrCat("ticket: ", Named(ticket), " was used already"));
    case State::kHeld:
    case State::kFetching:
      return absl::FailedPreconditionError(absl::StrCat("ticket: ", Named(ticket), " is an output's, for Fetch"));
  }
  if (auto s = Reserve(e->bytes, tenant, absl::StrCat("staging ", e->block.operand, " of ", Named(ticket)));
      !s.ok()) {
    return s;
  }
  e->state = State::kStaging;
  e->id = next_id_++;
  e->cancel = std::move(cancel);
  const absl::Duration renew_for = ttl == StageTtl::kFromLastData ? std::max(ttl_, idle) : absl::ZeroDuration();
  if (renew_for > absl::ZeroDuration()) e->expires = now_() + renew_for;
  *block = e->block;
  *worker = worker_name_;
  return std::unique_ptr<Upload>(new Upload(this, ticket, tenant, e->id, e->bytes, renew_for));
}

StagingArea::Upload::Upload(StagingArea* area, std::string ticket, std::string tenant, uint64_t id,
                            int64_t expected_bytes, absl::Duration renew_for)
    : area_(area),
      ticket_(std::move(ticket)),
      tenant_(std::move(tenant)),
      id_(id),
      expected_bytes_(expected_bytes),
      renew_for_(renew_for) {}

absl::Status StagingArea::Renew(const std::string& ticket, uint64_t id, absl::Duration renew_for) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(ticket);
  if (e != nullptr && e->state == State::kStaging && e->id == id) {
    e->expires = now_() + renew_for;
    return absl::OkStatus();
  }
  if (e != nullptr && e->state == State::kUsed) {
    return absl::FailedPreconditionError(absl::StrCat("ticket: ", Named(ticket), " was dropped while it was being "
                                                      "staged (its step failed, or its put was abandoned)"));
  }
  return absl::NotFoundError(absl::StrCat("ticket: ", Named(ticket), " expired while it was being staged: nothing "
                                          "arrived for ", absl::FormatDuration(renew_for),
                                          " (--staged_block_ttl, or the coordinator's --step_timeout if longer)"));
}

StagingArea::Upload::~Upload() {
  if (!committed_) Abandon();
}

void StagingArea::Upload::Abandon() {
  if (ended_) return;
  ended_ = true;
  writer_.reset();  // its memory first: a device block's copies in flight are its memory's to finish
  area_->EndUpload(ticket_, tenant_, id_, expected_bytes_);
}

absl::Status StagingArea::Upload::Append(absl::string_view data) {
  if (!failed_.ok()) return failed_;
  if (renew_for_ > absl::ZeroDuration()) {
    if (absl::Status s = area_->Renew(ticket_, id_, renew_for_); !s.ok()) return s;
  }
  if (received_ + static_cast<int64_t>(data.size()) > expected_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("data: more than the ", expected_bytes_, " bytes ",
                                                   Named(ticket_), " expects"));
  }
  if (data.empty()) return absl::OkStatus();
  if (writer_ == nullptr) return absl::FailedPreconditionError(absl::StrCat("data: ", Named(ticket_), " was committed"));
  if (absl::Status s = writer_->Append(data); !s.ok()) {
    failed_ = s;
    Abandon();
    return s;
  }
  received_ += static_cast<int64_t>(data.size());
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StagingArea::Upload::Commit() {
  if (!failed_.ok()) return failed_;
  if (received_ != expected_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("data: ", received_, " bytes, but ", Named(ticket_),
                                                   " expects ", expected_bytes_));
  }
  if (writer_ == nullptr) return absl::FailedPreconditionError(absl::StrCat("data: ", Named(ticket_), " was committed"));
  // Outside the lock: a device staging memory waits for its copies here.
  absl::StatusOr<StagedBytes> staged = writer_->Finish();
  writer_.reset();
  if (!staged.ok()) {
    failed_ = staged.status();
    Abandon();
    return failed_;
  }
  absl::MutexLock lock(&area_->mu_);
  Entry* e = area_->Find(ticket_);
  // Refused here, the block goes with `staged` and the reservation when the upload does.
  if (e != nullptr && e->state == State::kUsed) {
    failed_ = absl::FailedPreconditionError(absl::StrCat("ticket: ", Named(ticket_), " was dropped while it was "
                                                         "being staged (its step failed, or its put was abandoned)"));
    return failed_;
  }
  if (e == nullptr || e->state != State::kStaging || e->id != id_) {
    failed_ = absl::NotFoundError(absl::StrCat("ticket: ", Named(ticket_), " expired while it was being staged"));
    return failed_;
  }
  if (staged->device == nullptr && static_cast<int64_t>(staged->host.size()) != expected_bytes_) {
    failed_ = absl::InternalError(absl::StrCat("the staging memory kept ", staged->host.size(), " bytes of ",
                                               Named(ticket_), "'s ", expected_bytes_));
    return failed_;
  }
  auto t = std::make_shared<HostTensor>();
  t->dtype = e->block.dtype;
  t->shape = e->block.shape;
  t->bytes = std::move(staged->host);
  e->data = std::move(t);
  e->device = std::move(staged->device);
  e->state = State::kStaged;
  e->cancel = nullptr;
  e->expires = area_->now_() + area_->ttl_;  // a staged block waits a TTL for its step
  committed_ = true;  // the reservation is the entry's now
  return expected_bytes_;
}

void StagingArea::EndUpload(const std::string& ticket, const std::string& tenant, uint64_t id, int64_t reserved) {
  absl::MutexLock lock(&mu_);
  Unreserve(reserved, tenant);
  ForgetStream(id);
  auto it = entries_.find(ticket);
  if (it != entries_.end() && it->second.state == State::kStaging && it->second.id == id) {
    it->second.state = State::kExpected;  // may be staged again, until it expires
    it->second.cancel = nullptr;
  }
}

void StagingArea::ForgetStream(uint64_t id) { expired_streams_.erase(id); }

absl::StatusOr<HostTensor> StagingArea::Claim(const std::string& ticket, DType dtype,
                                              const std::vector<int64_t>& shape, absl::string_view field) {
  auto block = Take(ticket, dtype, shape, field, /*host_only=*/true);
  if (!block.ok()) return block.status();
  return std::move(block->tensor);
}

absl::StatusOr<StagedBlock> StagingArea::ClaimBlock(const std::string& ticket, DType dtype,
                                                    const std::vector<int64_t>& shape, absl::string_view field) {
  return Take(ticket, dtype, shape, field, /*host_only=*/false);
}

absl::StatusOr<StagedBlock> StagingArea::Take(const std::string& ticket, DType dtype,
                                              const std::vector<int64_t>& shape, absl::string_view field,
                                              bool host_only) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(ticket);
  if (e == nullptr) {
    return absl::NotFoundError(absl::StrCat(field, ".staged: ", Named(ticket), " is unknown on this worker or "
                                            "expired (--staged_block_ttl of ", absl::FormatDuration(ttl_), ")"));
  }
  switch (e->state) {
    case State::kStaged:
      break;
    case State::kUsed:
      return absl::FailedPreconditionError(absl::StrCat(field, ".staged: ", Named(ticket), " was used already"));
    case State::kExpected:
    case State::kStaging:
      return absl::FailedPreconditionError(absl::StrCat(
          field, ".staged: the block of ", Named(ticket), " was not staged on this worker (stage every block of "
          "the transfer plan before submitting the request)"));
    case State::kHeld:
    case State::kFetching:
      return absl::FailedPreconditionError(absl::StrCat(field, ".staged: ", Named(ticket), " is an output's"));
  }
  if (dtype != e->block.dtype || shape != e->block.shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".staged: the step's block is ", DTypeName(dtype), " ", ShapeToString(shape), " but ", Named(ticket),
        " was issued for ", DTypeName(e->block.dtype), " ", ShapeToString(e->block.shape)));
  }
  if (host_only && e->device != nullptr) {
    return absl::InternalError(absl::StrCat(field, ".staged: the block of ", Named(ticket),
                                            " is in device memory (ClaimBlock takes it)"));
  }
  StagedBlock out;
  out.tensor = std::move(*std::const_pointer_cast<HostTensor>(e->data));
  out.device = std::move(e->device);
  e->data.reset();
  e->device.reset();
  Unreserve(e->bytes, e->block.tenant);
  e->state = State::kUsed;  // remembered until it expires
  return out;
}

void StagingArea::Discard(const std::string& ticket) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(ticket);
  if (e == nullptr) {  // not here yet (an output its step has still to hold): refused when it comes
    Entry& used = entries_[ticket];
    used.state = State::kUsed;
    used.expires = now_() + ttl_;
    return;
  }
  if (e->state == State::kUsed) return;
  if (e->state == State::kStaged || e->state == State::kHeld || e->state == State::kFetching) {
    Unreserve(e->bytes, e->block.tenant);
  }
  // A stream still staging it frees its own reservation when it ends, and its Commit finds the ticket used;
  // the sweep ends that stream (or a fetch of it) now, not when its client finishes.
  if ((e->state == State::kStaging || e->state == State::kFetching) && e->cancel) {
    expired_streams_[e->id] = std::move(e->cancel);
  }
  e->data.reset();
  e->device.reset();
  e->cancel = nullptr;
  e->state = State::kUsed;
}

absl::Status StagingArea::Known(const std::string& ticket) {
  const Entry* e = Find(ticket);
  if (e == nullptr) return absl::OkStatus();
  if (e->state == State::kUsed) {
    return absl::FailedPreconditionError(absl::StrCat("out_staged: ", Named(ticket), " was dropped: the coordinator "
                                                      "gave up its request"));
  }
  return absl::AlreadyExistsError(absl::StrCat(Named(ticket), " is known already"));
}

absl::Status StagingArea::Hold(const std::string& ticket, const std::string& tenant, HostTensor block) {
  absl::MutexLock lock(&mu_);
  if (auto s = Known(ticket); !s.ok()) return s;
  if (auto s = Reserve(block.NumBytes(), tenant, "out_staged: holding the output block for a direct fetch");
      !s.ok()) {
    return s;
  }
  InsertHeld(ticket, tenant, std::make_shared<const HostTensor>(std::move(block)));
  return absl::OkStatus();
}

absl::Status StagingArea::HoldMade(const std::string& ticket, const std::string& tenant, int64_t bytes,
                                   const std::function<absl::StatusOr<std::shared_ptr<const HostTensor>>()>& make) {
  return HoldMadeAs(ticket, tenant, bytes, "holding a copy of the block for a direct fetch", make);
}

absl::Status StagingArea::HoldOutput(const std::string& ticket, const std::string& tenant, DType dtype,
                                     const std::vector<int64_t>& shape,
                                     const std::function<absl::Status(char* dst)>& fill) {
  ExpectedBlock expected;
  expected.dtype = dtype;
  expected.shape = shape;
  auto bytes = BlockBytes(expected);
  if (!bytes.ok()) return absl::InvalidArgumentError(absl::StrCat("out_staged: ", bytes.status().message()));
  return HoldMadeAs(ticket, tenant, *bytes, "out_staged: holding the output block for a direct fetch",
                    [&]() -> absl::StatusOr<std::shared_ptr<const HostTensor>> {
                      auto block = memory_->OutputBlock(dtype, shape, *bytes);
                      if (!block.ok()) return block.status();
                      if ((*block)->NumBytes() != *bytes) {
                        return absl::InternalError(absl::StrCat("the staging memory gave ", (*block)->NumBytes(),
                                                                " bytes for an output of ", *bytes));
                      }
                      if (*bytes > 0) {
                        if (auto s = fill(&(*block)->bytes[0]); !s.ok()) return s;
                      }
                      return std::shared_ptr<const HostTensor>(*std::move(block));
                    });
}

absl::Status StagingArea::HoldMadeAs(const std::string& ticket, const std::string& tenant, int64_t bytes,
                                     absl::string_view what,
                                     const std::function<absl::StatusOr<std::shared_ptr<const HostTensor>>()>& make) {
  {
    absl::MutexLock lock(&mu_);
    if (auto s = Known(ticket); !s.ok()) return s;
    if (auto s = Reserve(bytes, tenant, what); !s.ok()) return s;
  }
  absl::StatusOr<std::shared_ptr<const HostTensor>> block = make();
  if (block.ok() && *block == nullptr) block = absl::InternalError("no block to hold");
  absl::MutexLock lock(&mu_);
  if (!block.ok() || (*block)->NumBytes() != bytes || Find(ticket) != nullptr) {
    Unreserve(bytes, tenant);
    if (!block.ok()) return block.status();
    if ((*block)->NumBytes() != bytes) {
      return absl::InternalError(absl::StrCat("the block to hold has ", (*block)->NumBytes(), " bytes, not ", bytes));
    }
    return Known(ticket);
  }
  InsertHeld(ticket, tenant, *std::move(block));
  return absl::OkStatus();
}

void StagingArea::InsertHeld(const std::string& ticket, const std::string& tenant,
                             std::shared_ptr<const HostTensor> block) {
  Entry& e = entries_[ticket];
  e.block.tenant = tenant;
  e.block.operand = "out";
  e.block.dtype = block->dtype;
  e.block.shape = block->shape;
  e.bytes = block->NumBytes();
  e.state = State::kHeld;
  e.expires = now_() + ttl_;
  e.data = std::move(block);
}

absl::StatusOr<std::unique_ptr<StagingArea::Download>> StagingArea::BeginFetch(const std::string& ticket,
                                                                              const std::string& tenant,
                                                                              CancelStream cancel) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(ticket);
  if (e == nullptr || e->state == State::kExpected || e->state == State::kStaging || e->state == State::kStaged) {
    return absl::NotFoundError(absl::StrCat("ticket: ", Named(ticket), " names no output block held on this "
                                            "worker (unknown, or expired after --staged_block_ttl of ",
                                            absl::FormatDuration(ttl_), ")"));
  }
  if (e->block.tenant != tenant) {
    return absl::PermissionDeniedError(absl::StrCat("ticket: ", Named(ticket), " was issued to another tenant"));
  }
  if (e->state == State::kUsed) {
    return absl::FailedPreconditionError(absl::StrCat("ticket: ", Named(ticket), " was fetched already"));
  }
  if (e->state == State::kFetching) {
    return absl::FailedPreconditionError(absl::StrCat("ticket: ", Named(ticket), " is being fetched"));
  }
  e->state = State::kFetching;
  e->id = next_id_++;
  e->cancel = std::move(cancel);
  return std::unique_ptr<Download>(new Download(this, ticket, e->id, e->data));
}

StagingArea::Download::Download(StagingArea* area, std::string ticket, uint64_t id,
                                std::shared_ptr<const HostTensor> block)
    : area_(area), ticket_(std::move(ticket)), id_(id), block_(std::move(block)) {}

StagingArea::Download::~Download() {
  if (!done_) area_->EndDownload(ticket_, id_, /*done=*/false);
}

void StagingArea::Download::Done() {
  if (done_) return;
  done_ = true;
  area_->EndDownload(ticket_, id_, /*done=*/true);
  block_.reset();
}

void StagingArea::EndDownload(const std::string& ticket, uint64_t id, bool done) {
  absl::MutexLock lock(&mu_);
  ForgetStream(id);
  auto it = entries_.find(ticket);
  if (it == entries_.end() || it->second.state != State::kFetching || it->second.id != id) return;  // expired
  it->second.cancel = nullptr;
  if (!done) {
    it->second.state = State::kHeld;  // may be fetched again, until it expires
    return;
  }
  Unreserve(it->second.bytes, it->second.block.tenant);
  it->second.data.reset();
  it->second.state = State::kUsed;
}

int StagingArea::Sweep() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = now_();
  int dropped = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (it->second.expires <= now) {
      Drop(it);
      ++dropped;
    }
    it = next;
  }
  for (auto& [id, cancel] : expired_streams_) cancel();
  expired_streams_.clear();
  return dropped;
}

int64_t StagingArea::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

int64_t StagingArea::held_bytes_of(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = held_by_tenant_.find(tenant);
  return it == held_by_tenant_.end() ? 0 : it->second;
}

size_t StagingArea::tickets() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace shardgemm
