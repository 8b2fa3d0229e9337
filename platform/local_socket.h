// A Unix-domain socket in a directory only this user can enter, for a hop
// between two processes of one host (a worker serving its coordinator), and
// the check that a socket someone describes is that very socket on this
// host: the same kernel (boot id), the same file (inode), a socket, owned by
// this user.
#ifndef SHARDGEMM_PLATFORM_LOCAL_SOCKET_H_
#define SHARDGEMM_PLATFORM_LOCAL_SOCKET_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardgemm::platform {

// This kernel's boot id (/proc/sys/kernel/random/boot_id): two processes see
// the same one exactly when they run on one host. Empty when unreadable.
std::string BootId();

// A fresh directory (mode 0700, under `parent`) holding the path of one
// socket; both are removed when this goes. The socket itself is made by
// whoever binds `socket_path()`.
class PrivateSocketDir {
 public:
  static absl::StatusOr<PrivateSocketDir> Create(const std::string& parent, const std::string& socket_name);
  PrivateSocketDir(PrivateSocketDir&& other) noexcept;
  PrivateSocketDir& operator=(PrivateSocketDir&& other) noexcept;
  PrivateSocketDir(const PrivateSocketDir&) = delete;
  PrivateSocketDir& operator=(const PrivateSocketDir&) = delete;
  ~PrivateSocketDir();

  const std::string& dir() const { return dir_; }
  const std::string& socket_path() const { return socket_path_; }

 private:
  PrivateSocketDir() = default;
  void Remove();

  std::string dir_;
  std::string socket_path_;
};

// Removes the directories PrivateSocketDir made under `parent` for
// `socket_name` that a process killed before it could remove them left
// behind: owned by this user, mode 0700, holding nothing but that socket,
// which nothing listens on (a connect is refused) and which is older than
// `min_age` (a live server binds and listens within moments); or empty and
// older than `min_age`. Anything else is left alone. Returns how many went.
int RemoveStaleSocketDirs(const std::string& parent, const std::string& socket_name, absl::Duration min_age);

// Makes `path` free for a server to bind a Unix socket at (a coordinator's
// --client_socket): nothing there, or a socket nothing listens on (a killed
// server's), which is removed. FAILED_PRECONDITION naming `flag` when
// something else is there, a live server listens on it, or its directory is
// not this user's alone to write (another user could bind the path first and
// collect the tokens clients send there); INVALID_ARGUMENT
// when the path is empty, not absolute or too long for a socket address.
//
// The claim holds an exclusive lock (flock) on PATH.lock for as long as it
// lives, so two servers of this user started at once on one path cannot both
// pass the check (the second is FAILED_PRECONDITION); the lock file stays.
class SocketPathClaim {
 public:
  SocketPathClaim(SocketPathClaim&& other) noexcept;
  SocketPathClaim& operator=(SocketPathClaim&& other) noexcept;
  SocketPathClaim(const SocketPathClaim&) = delete;
  SocketPathClaim& operator=(const SocketPathClaim&) = delete;
  // Removes the socket if Bound() noted it and it is still that file (not a
  // successor's), then lets go of the lock.
  ~SocketPathClaim();

  // Once the server has bound the path (owner-only, under umask 0177): gives
  // the socket `mode` and notes its inode. On failure the socket is removed.
  absl::Status Bound(unsigned mode);

 private:
  friend absl::StatusOr<SocketPathClaim> ClaimSocketPath(const std::string& path, const std::string& flag);
  SocketPathClaim(std::string path, int lock_fd) : path_(std::move(path)), lock_fd_(lock_fd) {}
  void Release();

  std::string path_;
  int lock_fd_ = -1;
  uint64_t bound_inode_ = 0;  // 0: not bound
};
absl::StatusOr<SocketPathClaim> ClaimSocketPath(const std::string& path, const std::string& flag);

// Parses a socket file's mode, octal ("0600", "660"): INVALID_ARGUMENT
// naming `flag` unless it is 0-0777 with the owner's read and write bits.
absl::StatusOr<unsigned> ParseSocketMode(const std::string& text, const std::string& flag);

// The inode of the socket at `path`: FAILED_PRECONDITION when there is none,
// or it is not a socket.
absl::StatusOr<uint64_t> SocketInode(const std::string& path);

// Whether `path` is, on this host, the socket (`boot_id`, `inode`) a peer
// described, owned by this process's user. When it is not, why.
absl::Status CheckSameHostSocket(const std::string& path, const std::string& boot_id, uint64_t inode);

}  // namespace shardgemm::platform

#endif  // SHARDGEMM_PLATFORM_LOCAL_SOCKET_H_
