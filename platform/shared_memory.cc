#include "platform/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardgemm::platform {
namespace {

absl::Status OpenError(int err, const std::string& key, absl::string_view field) {
  const std::string what = absl::StrCat(field, ": shared-memory object '", key, "': ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(absl::StrCat(what, " (none of that name on this host)"));
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(what);
  return absl::FailedPreconditionError(what);
}

// a * b, false on overflow past int64.
bool MulChecked(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

}  // namespace

absl::Status CheckSharedMemoryKey(absl::string_view key, absl::string_view field) {
  if (key.size() < 2 || key.size() > 255 || key[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", key, "' is not a shared-memory name ('/' then 1 to 254 characters)"));
  }
  for (char c : key.substr(1)) {
    if (c == '/' || c == '\0') {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", key, "' is not a shared-memory name (no '/' after the first)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SharedMemoryObjectSize(const std::string& key, absl::string_view field) {
  if (auto s = CheckSharedMemoryKey(key, field); !s.ok()) return s;
  const int fd = shm_open(key.c_str(), O_RDONLY, 0);
  if (fd < 0) return OpenError(errno, key, field);
  struct stat st;
  const int r = fstat(fd, &st);
  const int err = errno;
  close(fd);
  if (r != 0) return OpenError(err, key, field);
  return static_cast<uint64_t>(st.st_size);
}

namespace {

// An object opened for a mapping of its first `bytes`: the descriptor and
// which object it is.
struct OpenObject {
  int fd = -1;
  uint64_t device = 0, inode = 0;
};

absl::StatusOr<OpenObject> OpenForMapping(const std::string& key, uint64_t bytes, bool writable,
                                          absl::string_view field) {
  if (auto s = CheckSharedMemoryKey(key, field); !s.ok()) return s;
  if (bytes == 0) return absl::InvalidArgumentError(absl::StrCat(field, ": a region of 0 bytes"));
  const int fd = shm_open(key.c_str(), writable ? O_RDWR : O_RDONLY, 0);
  if (fd < 0) return OpenError(errno, key, field);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return OpenError(err, key, field);
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(field, ": shared-memory object '", key, "' has ", st.st_size,
                                                      " bytes, fewer than the ", bytes, " registered"));
  }
  return OpenObject{fd, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

// Maps the object's first `bytes` and closes its descriptor (the mapping
// keeps the object).
absl::StatusOr<char*> MapAndClose(int fd, uint64_t bytes, bool writable, const std::string& key,
                                  absl::string_view field) {
  void* p = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) return OpenError(err, key, field);
  return static_cast<char*>(p);
}

}  // namespace

absl::StatusOr<SharedMemoryMapping> SharedMemoryMapping::Map(const std::string& key, uint64_t bytes, bool writable,
                                                             absl::string_view field) {
  auto object = OpenForMapping(key, bytes, writable, field);
  if (!object.ok()) return object.status();
  auto data = MapAndClose(object->fd, bytes, writable, key, field);
  if (!data.ok()) return data.status();
  return SharedMemoryMapping(*data, bytes);
}

absl::StatusOr<std::shared_ptr<const SharedMemoryMapping>> SharedMemoryMappings::Get(const std::string& key,
                                                                                     uint64_t bytes, bool writable,
                                                                                     absl::string_view field) {
  auto object = OpenForMapping(key, bytes, writable, field);
  if (!object.ok()) return object.status();
  const int fd = object->fd;
  const uint64_t device = object->device, inode = object->inode;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->key == key && it->bytes == bytes && it->writable == writable && it->device == device &&
          it->inode == inode) {
        Entry hit = std::move(*it);
        entries_.erase(it);
        entries_.push_back(std::move(hit));
        close(fd);
        return entries_.back().mapping;
      }
    }
  }
  auto data = MapAndClose(fd, bytes, writable, key, field);
  if (!data.ok()) return data.status();
  auto mapping = std::shared_ptr<const SharedMemoryMapping>(new SharedMemoryMapping(*data, bytes));
  absl::MutexLock lock(&mu_);
  // An older entry of the same name (another object, or another size) goes.
  for (auto it = entries_.begin(); it != entries_.end();) {
    it = it->key == key && it->writable == writable ? entries_.erase(it) : std::next(it);
  }
  entries_.push_back(Entry{key, bytes, writable, device, inode, mapping});
  while (entries_.size() > capacity_) entries_.pop_front();  // a caller may still hold it: shared
  return mapping;
}

std::vector<std::shared_ptr<const SharedMemoryMapping>> SharedMemoryMappings::Forget(const std::string& key) {
  std::vector<std::shared_ptr<const SharedMemoryMapping>> forgotten;
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->key != key) {
      ++it;
      continue;
    }
    forgotten.push_back(std::move(it->mapping));
    it = entries_.erase(it);
  }
  return forgotten;
}

size_t SharedMemoryMappings::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

SharedMemoryMapping::SharedMemoryMapping(SharedMemoryMapping&& other) noexcept
    : data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

SharedMemoryMapping& SharedMemoryMapping::operator=(SharedMemoryMapping&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, size_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

SharedMemoryMapping::~SharedMemoryMapping() {
  if (data_ != nullptr) munmap(data_, size_);
}

absl::Status CheckTensorBlock(const TensorBlock& b, uint64_t region_bytes, absl::string_view field) {
  const size_t rank = b.global_shape.size();
  if (b.block_offsets.size() != rank || b.block_shape.size() != rank || b.element_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": a block of rank ", b.block_shape.size(), " at ",
                                                   b.block_offsets.size(), " offsets of a rank-", rank, " tensor"));
  }
  int64_t bytes = b.element_bytes;
  for (size_t d = 0; d < rank; ++d) {
    if (b.global_shape[d] < 0 || b.block_shape[d] < 0 || b.block_offsets[d] < 0 ||
        b.block_offsets[d] > b.global_shape[d] || b.block_shape[d] > b.global_shape[d] - b.block_offsets[d]) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": block [", absl::StrJoin(b.block_offsets, ","), "] + [", absl::StrJoin(b.block_shape, ","),
          "] is not inside the tensor [", absl::StrJoin(b.global_shape, ","), "]"));
    }
    if (!MulChecked(bytes, b.global_shape[d], &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": the tensor's size overflows"));
    }
  }
  if (b.offset > region_bytes || static_cast<uint64_t>(bytes) > region_bytes - b.offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", bytes, " bytes at offset ", b.offset,
                                                   " run past the region's ", region_bytes, " bytes"));
  }
  return absl::OkStatus();
}

namespace {

// Visits the block's contiguous runs (along its last dim): `run(region
// byte offset, block byte offset, bytes)`.
template <typename Run>
void ForEachRun(const TensorBlock& b, Run run) {
  const size_t rank = b.global_shape.size();
  for (int64_t d : b.block_shape) {
    if (d == 0) return;
  }
  if (rank == 0) {
    run(b.offset, 0, static_cast<uint64_t>(b.element_bytes));
    return;
  }
  // Row-major strides of the tensor, in elements.
  std::vector<int64_t> stride(rank, 1);
  for (size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * b.global_shape[d];
  const uint64_t run_bytes = static_cast<uint64_t>(b.block_shape[rank - 1] * b.element_bytes);
  std::vector<int64_t> index(rank, 0);  // within the block, last dim fixed at 0
  uint64_t local = 0;
  while (true) {
    int64_t element = 0;
    for (size_t d = 0; d < rank; ++d) element += (b.block_offsets[d] + index[d]) * stride[d];
    run(b.offset + static_cast<uint64_t>(element * b.element_bytes), local, run_bytes);
    local += run_bytes;
    // Next run: odometer over all but the last dim.
    size_t d = rank - 1;
    while (d > 0) {
      --d;
      if (++index[d] < b.block_shape[d]) break;
      index[d] = 0;
      if (d == 0) return;
    }
    if (rank == 1) return;
  }
}

}  // namespace

absl::Status CopyBlockOut(const SharedMemoryMapping& mapping, const TensorBlock& block, char* dst,
                          absl::string_view field) {
  if (auto s = CheckTensorBlock(block, mapping.size(), field); !s.ok()) return s;
  ForEachRun(block, [&](uint64_t at, uint64_t local, uint64_t n) { std::memcpy(dst + local, mapping.data() + at, n); });
  return absl::OkStatus();
}

absl::Status CopyBlockIn(const SharedMemoryMapping& mapping, const TensorBlock& block, const char* src,
                         absl::string_view field) {
  if (auto s = CheckTensorBlock(block, mapping.size(), field); !s.ok()) return s;
  ForEachRun(block, [&](uint64_t at, uint64_t local, uint64_t n) { std::memcpy(mapping.data() + at, src + local, n); });
  return absl::OkStatus();
}

std::vector<BlockPiece> BlockPieces(const TensorBlock& b) {
  std::vector<BlockPiece> pieces;
  const size_t rank = b.global_shape.size();
  for (int64_t d : b.block_shape) {
    if (d == 0) return pieces;
  }
  if (rank == 0) {
    pieces.push_back({b.offset, static_cast<uint64_t>(b.element_bytes), 0, static_cast<uint64_t>(b.element_bytes), 1});
    return pieces;
  }
  // The trailing dims the block covers whole, with the one before them,
  // make each row contiguous; the dim before that gives the rows.
  size_t first_whole = rank;
  while (first_whole > 0 && b.block_offsets[first_whole - 1] == 0 &&
         b.block_shape[first_whole - 1] == b.global_shape[first_whole - 1]) {
    --first_whole;
  }
  // Row-major strides of the tensor, in bytes.
  std::vector<uint64_t> stride(rank, static_cast<uint64_t>(b.element_bytes));
  for (size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * static_cast<uint64_t>(b.global_shape[d]);
  // One contiguous run: dims [run_dim, rank) of the block.
  const size_t run_dim = first_whole == 0 ? 0 : first_whole - 1;
  const uint64_t row_bytes = static_cast<uint64_t>(b.block_shape[run_dim]) * stride[run_dim];
  if (run_dim == 0) {
    pieces.push_back({b.offset + static_cast<uint64_t>(b.block_offsets[0]) * stride[0], row_bytes, 0, row_bytes, 1});
    return pieces;
  }
  // Rows along run_dim - 1, and along the dims before it while the dims
  // after them are whole (their rows are then evenly spaced); an odometer
  // over the dims before those, one piece each.
  const size_t row_dim = run_dim - 1;
  size_t rows_from = row_dim;
  auto whole = [&](size_t d) { return b.block_offsets[d] == 0 && b.block_shape[d] == b.global_shape[d]; };
  while (rows_from > 0 && whole(rows_from)) --rows_from;
  uint64_t rows = 1;
  for (size_t d = rows_from; d <= row_dim; ++d) rows *= static_cast<uint64_t>(b.block_shape[d]);
  std::vector<int64_t> index(rows_from, 0);
  uint64_t local = 0;
  while (true) {
    uint64_t at = b.offset;
    for (size_t d = 0; d < rank; ++d) {
      const int64_t i = d < rows_from ? index[d] : 0;
      at += static_cast<uint64_t>(b.block_offsets[d] + i) * stride[d];
    }
    pieces.push_back({at, stride[row_dim], local, row_bytes, rows});
    local += rows * row_bytes;
    size_t d = rows_from;
    if (d == 0) return pieces;
    while (d > 0) {
      --d;
      if (++index[d] < b.block_shape[d]) break;
      index[d] = 0;
      if (d == 0) return pieces;
    }
  }
}

bool BlockIsContiguous(const TensorBlock& b) {
  auto pieces = BlockPieces(b);
  return pieces.size() <= 1 && (pieces.empty() || pieces[0].rows == 1 || pieces[0].region_pitch == pieces[0].row_bytes);
}

}  // namespace shardgemm::platform
