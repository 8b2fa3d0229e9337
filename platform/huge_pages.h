// Transparent huge pages for large buffers about to be filled once (a
// staged block, a fetched tensor): a fresh 4 KiB page costs a fault and a
// zeroing each, so filling hundreds of MiB spends much of its time in the
// kernel; with 2 MiB pages that is 512 times fewer faults. Where the kernel
// gives huge pages only on request (transparent_hugepage=madvise, a common
// default) this is the request.
#ifndef SHARDGEMM_PLATFORM_HUGE_PAGES_H_
#define SHARDGEMM_PLATFORM_HUGE_PAGES_H_

#include <cstddef>

namespace shardgemm::platform {

// Below this a buffer is left alone (it holds no whole huge page worth asking for).
inline constexpr size_t kHugePageAdviceMinBytes = size_t{4} << 20;

// Asks for huge pages over the whole 2 MiB pages inside [data, data + bytes),
// before they are touched. Best effort: false when not asked (too small) or
// refused (no THP, an old kernel); the buffer works the same either way.
bool AdviseHugePages(void* data, size_t bytes);

}  // namespace shardgemm::platform

#endif  // SHARDGEMM_PLATFORM_HUGE_PAGES_H_
