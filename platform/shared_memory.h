// POSIX shared-memory objects of same-host clients (shm_open names): the
// checks on a name, its size, a mapping, and copying one block of a
// row-major tensor out of or into it, bounds-checked.
#ifndef SHARDGEMM_PLATFORM_SHARED_MEMORY_H_
#define SHARDGEMM_PLATFORM_SHARED_MEMORY_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace shardgemm::platform {

// '/' then 1 to 254 characters, none of them '/' or NUL (POSIX's portable
// shm_open name). INVALID_ARGUMENT naming `field` otherwise.
absl::Status CheckSharedMemoryKey(absl::string_view key, absl::string_view field);

// The size of the object `key` names: NOT_FOUND (naming `field`) when there
// is none on this host, PERMISSION_DENIED when it cannot be opened.
absl::StatusOr<uint64_t> SharedMemoryObjectSize(const std::string& key, absl::string_view field);

// The first `bytes` of an object, mapped (shared: writes reach the client).
class SharedMemoryMapping {
 public:
  // FAILED_PRECONDITION when the object is smaller than `bytes` (it shrank
  // since it was registered).
  static absl::StatusOr<SharedMemoryMapping> Map(const std::string& key, uint64_t bytes, bool writable,
                                                 absl::string_view field);
  SharedMemoryMapping(SharedMemoryMapping&& other) noexcept;
  SharedMemoryMapping& operator=(SharedMemoryMapping&& other) noexcept;
  SharedMemoryMapping(const SharedMemoryMapping&) = delete;
  SharedMemoryMapping& operator=(const SharedMemoryMapping&) = delete;
  ~SharedMemoryMapping();

  char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  friend class SharedMemoryMappings;
  SharedMemoryMapping(char* data, uint64_t size) : data_(data), size_(size) {}
  char* data_ = nullptr;
  uint64_t size_ = 0;
};

// Mappings kept across calls, so a region's pages stay mapped (a fresh
// mapping faults every page in again). An entry is used only while the name
// still opens the same object (device and inode) with at least its bytes: a
// client that removes and recreates an object gets a fresh mapping.
class SharedMemoryMappings {
 public:
  explicit SharedMemoryMappings(size_t capacity) : capacity_(capacity) {}
  absl::StatusOr<std::shared_ptr<const SharedMemoryMapping>> Get(const std::string& key, uint64_t bytes,
                                                                 bool writable, absl::string_view field);
  size_t size() const;
  // Drops `key`'s mappings from the cache and returns them: each is unmapped
  // once the last holder (a step still using it, a pinned registration)
  // lets it go.
  std::vector<std::shared_ptr<const SharedMemoryMapping>> Forget(const std::string& key);

 private:
  struct Entry {
    std::string key;
    uint64_t bytes = 0;
    bool writable = false;
    uint64_t device = 0, inode = 0;
    std::shared_ptr<const SharedMemoryMapping> mapping;
  };
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<Entry> entries_ ABSL_GUARDED_BY(mu_);  // most recent last
};

// Where one block of a row-major tensor lies in a mapping.
struct TensorBlock {
  uint64_t offset = 0;                 // of the tensor's first byte
  std::vector<int64_t> global_shape;   // the whole tensor
  std::vector<int64_t> block_offsets;  // the block's first index per dim
  std::vector<int64_t> block_shape;
  int64_t element_bytes = 0;
};

// INVALID_ARGUMENT naming `field` unless the block lies in the tensor and
// the tensor in the first `region_bytes` of the region.
absl::Status CheckTensorBlock(const TensorBlock& block, uint64_t region_bytes, absl::string_view field);

// The block's bytes, row-major, into `dst` (prod(block_shape) *
// element_bytes bytes) / from `src` into the region.
absl::Status CopyBlockOut(const SharedMemoryMapping& mapping, const TensorBlock& block, char* dst,
                          absl::string_view field);
absl::Status CopyBlockIn(const SharedMemoryMapping& mapping, const TensorBlock& block, const char* src,
                         absl::string_view field);

// A block as strided 2-D copies (what cudaMemcpy2D takes): `rows` rows of
// `row_bytes` each, `region_pitch` apart in the region from
// `region_offset` on, packed (`row_bytes` apart) in the block from
// `block_offset` on. A block whose rows are whole rows of the tensor is one
// piece of one row.
struct BlockPiece {
  uint64_t region_offset = 0;
  uint64_t region_pitch = 0;
  uint64_t block_offset = 0;
  uint64_t row_bytes = 0;
  uint64_t rows = 0;
};
// The block's pieces in block order (none for an empty block). The block
// must pass CheckTensorBlock.
std::vector<BlockPiece> BlockPieces(const TensorBlock& block);
// True when the block is one run of the region's bytes (it can be used in place).
bool BlockIsContiguous(const TensorBlock& block);

}  // namespace shardgemm::platform

#endif  // SHARDGEMM_PLATFORM_SHARED_MEMORY_H_
