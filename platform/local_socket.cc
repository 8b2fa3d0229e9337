#include "platform/local_socket.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

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
