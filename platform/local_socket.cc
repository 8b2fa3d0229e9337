#include "platform/local_socket.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace shardgemm::platform {

std::string BootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return std::string(absl::StripAsciiWhitespace(id));
}

absl::StatusOr<PrivateSocketDir> PrivateSocketDir::Create(const std::string& parent,
                                                          const std::string& socket_name) {
  if (socket_name.empty() || socket_name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("socket name '", socket_name, "' must be one path component"));
  }
  std::string templ = absl::StrCat(parent.empty() ? "/tmp" : parent, "/shardgemm-XXXXXX");
  // sun_path holds 108 bytes with its NUL.
  if (templ.size() + 1 + socket_name.size() > 107) {
    return absl::InvalidArgumentError(absl::StrCat("socket path ", templ, "/", socket_name,
                                                   " is longer than a Unix socket's 107 bytes"));
  }
  std::vector<char> buffer(templ.begin(), templ.end());
  buffer.push_back('\0');
  if (mkdtemp(buffer.data()) == nullptr) {  // mode 0700
    return absl::FailedPreconditionError(
        absl::StrCat("cannot make a private directory under ", parent, ": ", std::strerror(errno)));
  }
  PrivateSocketDir dir;
  dir.dir_ = buffer.data();
  dir.socket_path_ = absl::StrCat(dir.dir_, "/", socket_name);
  return dir;
}

PrivateSocketDir::PrivateSocketDir(PrivateSocketDir&& other) noexcept
    : dir_(std::move(other.dir_)), socket_path_(std::move(other.socket_path_)) {
  other.dir_.clear();
  other.socket_path_.clear();
}

PrivateSocketDir& PrivateSocketDir::operator=(PrivateSocketDir&& other) noexcept {
  if (this != &other) {
    Remove();
    dir_ = std::move(other.dir_);
    socket_path_ = std::move(other.socket_path_);
    other.dir_.clear();
    other.socket_path_.clear();
  }
  return *this;
}

PrivateSocketDir::~PrivateSocketDir() { Remove(); }

void PrivateSocketDir::Remove() {
  if (dir_.empty()) return;
  unlink(socket_path_.c_str());
  rmdir(dir_.c_str());
  dir_.clear();
  socket_path_.clear();
}

namespace {

constexpr char kDirPrefix[] = "shardgemm-";
constexpr size_t kDirSuffixLength = 6;  // mkdtemp's XXXXXX

bool OlderThan(const struct stat& st, absl::Duration age) {
  return absl::Now() - absl::FromUnixSeconds(st.st_mtime) > age &&
         absl::Now() - absl::FromUnixSeconds(st.st_ctime) > age;
}

// Whether a connect to the socket at `path` is refused: nothing listens.
bool NothingListens(const std::string& path) {
  // Non-blocking: a full backlog (a stopped server) answers EAGAIN at once.
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    close(fd);
    return false;
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const bool refused = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno == ECONNREFUSED;
  close(fd);
  return refused;
}

}  // namespace

int RemoveStaleSocketDirs(const std::string& parent, const std::string& socket_name, absl::Duration min_age) {
  const std::string root = parent.empty() ? "/tmp" : parent;
  DIR* d = opendir(root.c_str());
  if (d == nullptr) return 0;
  std::vector<std::string> candidates;
  while (const dirent* e = readdir(d)) {
    const absl::string_view name = e->d_name;
    if (absl::StartsWith(name, kDirPrefix) && name.size() == sizeof(kDirPrefix) - 1 + kDirSuffixLength) {
      candidates.emplace_back(name);
    }
  }
  closedir(d);
  int removed = 0;
  for (const std::string& name : candidates) {
    const std::string dir = absl::StrCat(root, "/", name);
    struct stat st;
    if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() ||
        (st.st_mode & 07777) != 0700) {
      continue;
    }
    DIR* inner = opendir(dir.c_str());
    if (inner == nullptr) continue;
    bool only_the_socket = true, has_socket = false;
    while (const dirent* e = readdir(inner)) {
      const absl::string_view entry = e->d_name;
      if (entry == "." || entry == "..") continue;
      if (entry == socket_name) {
        has_socket = true;
      } else {
        only_the_socket = false;
      }
    }
    closedir(inner);
    if (!only_the_socket) continue;
    if (has_socket) {
      const std::string socket_path = absl::StrCat(dir, "/", socket_name);
      struct stat sock;
      if (lstat(socket_path.c_str(), &sock) != 0 || !S_ISSOCK(sock.st_mode) || sock.st_uid != geteuid() ||
          !OlderThan(sock, min_age) || !NothingListens(socket_path)) {
        continue;
      }
      if (unlink(socket_path.c_str()) != 0) continue;
    } else if (!OlderThan(st, min_age)) {
      continue;  // a server between making its directory and binding
    }
    if (rmdir(dir.c_str()) == 0) ++removed;
  }
  return removed;
}

SocketPathClaim::SocketPathClaim(SocketPathClaim&& other) noexcept
    : path_(std::move(other.path_)), lock_fd_(other.lock_fd_), bound_inode_(other.bound_inode_) {
  other.lock_fd_ = -1;
  other.bound_inode_ = 0;
}

SocketPathClaim& SocketPathClaim::operator=(SocketPathClaim&& other) noexcept {
  if (this != &other) {
    Release();
    path_ = std::move(other.path_);
    lock_fd_ = other.lock_fd_;
    bound_inode_ = other.bound_inode_;
    other.lock_fd_ = -1;
    other.bound_inode_ = 0;
  }
  return *this;
}

SocketPathClaim::~SocketPathClaim() { Release(); }

void SocketPathClaim::Release() {
  if (bound_inode_ != 0) {
    if (auto inode = SocketInode(path_); inode.ok() && *inode == bound_inode_) unlink(path_.c_str());
    bound_inode_ = 0;
  }
  if (lock_fd_ >= 0) close(lock_fd_);
  lock_fd_ = -1;
}

absl::Status SocketPathClaim::Bound(unsigned mode) {
  auto inode = SocketInode(path_);
  if (!inode.ok() || chmod(path_.c_str(), mode) != 0) {
    const std::string why = inode.ok() ? std::strerror(errno) : std::string(inode.status().message());
    unlink(path_.c_str());
    return absl::FailedPreconditionError(absl::StrCat(path_, ": ", why));
  }
  bound_inode_ = *inode;
  return absl::OkStatus();
}

absl::StatusOr<SocketPathClaim> ClaimSocketPath(const std::string& path, const std::string& flag) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' is not an absolute path"));
  }
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' is ", path.size(),
                                                   " bytes; a Unix socket's path is at most ",
                                                   sizeof(sockaddr_un{}.sun_path) - 1));
  }
  // Clients trust whatever listens at the path (local credentials prove
  // nothing about the server): only this user may create or replace it.
  const std::string parent = path.substr(0, std::max<size_t>(path.rfind('/'), 1));
  struct stat dir;
  if (stat(parent.c_str(), &dir) != 0 || !S_ISDIR(dir.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(flag, ": ", parent, " is not a directory"));
  }
  if (dir.st_uid != geteuid() || (dir.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": ", parent,
                     " must be a directory of this user's that no one else can write (e.g. mode 0700 or 0755): "
                     "in a shared one another user could bind the path first and collect clients' tokens"));
  }
  const std::string lock_path = path + ".lock";
  const int lock_fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (lock_fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(flag, ": ", lock_path, ": ", std::strerror(errno)));
  }
  SocketPathClaim claim(path, lock_fd);
  if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": another server holds ", lock_path, " (it serves or is about to serve ", path, ")"));
  }
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return claim;
    return absl::FailedPreconditionError(absl::StrCat(flag, ": ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(flag, ": ", path, " exists and is not a socket"));
  }
  if (!NothingListens(path)) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": another process serves ", path, " (or it cannot be told that nothing does)"));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": cannot remove the stale socket ", path, ": ", std::strerror(errno)));
  }
  return claim;
}

absl::StatusOr<unsigned> ParseSocketMode(const std::string& text, const std::string& flag) {
  unsigned mode = 0;
  bool ok = !text.empty() && text.size() <= 4;
  for (char c : text) ok = ok && c >= '0' && c <= '7';
  if (ok) mode = static_cast<unsigned>(std::strtoul(text.c_str(), nullptr, 8));
  if (!ok || mode > 0777) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", text, "' is not an octal file mode (e.g. 0600)"));
  }
  if ((mode & 0600) != 0600) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", text, "' leaves the owner without read and write (the server's own)"));
  }
  return mode;
}

absl::StatusOr<uint64_t> SocketInode(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(path, " is not a socket"));
  return static_cast<uint64_t>(st.st_ino);
}

absl::Status CheckSameHostSocket(const std::string& path, const std::string& boot_id, uint64_t inode) {
  const std::string ours = BootId();
  if (ours.empty() || boot_id != ours) return absl::FailedPreconditionError("another host (its boot id differs)");
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not reachable here: ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(path, " is not a socket"));
  if (static_cast<uint64_t>(st.st_ino) != inode) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is another file than the one described"));
  }
  if (st.st_uid != geteuid()) {
    return absl::FailedPreconditionError(absl::StrCat(path, " belongs to another user"));
  }
  return absl::OkStatus();
}

}  // namespace shardgemm::platform
