#include "platform/local_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace shardgemm::platform {
namespace {

int BindUnixSocket(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST(LocalSocketTest, BootIdIsReadable) {
  const std::string id = BootId();
  EXPECT_EQ(id.size(), 36u) << id;  // a UUID
  EXPECT_EQ(BootId(), id);
}

TEST(LocalSocketTest, PrivateDirIsOnlyOursAndGoesAway) {
  std::string dir;
  {
    auto made = PrivateSocketDir::Create("/tmp", "worker.sock");
    ASSERT_TRUE(made.ok()) << made.status();
    dir = made->dir();
    struct stat st;
    ASSERT_EQ(stat(dir.c_str(), &st), 0);
    EXPECT_TRUE(S_ISDIR(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    EXPECT_EQ(made->socket_path(), dir + "/worker.sock");
    int fd = BindUnixSocket(made->socket_path());
    ASSERT_GE(fd, 0);
    close(fd);
  }
  struct stat st;
  EXPECT_NE(stat(dir.c_str(), &st), 0) << dir << " was not removed";
}

TEST(LocalSocketTest, RefusesBadNamesAndLongPaths) {
  EXPECT_FALSE(PrivateSocketDir::Create(::testing::TempDir(), "a/b").ok());
  EXPECT_FALSE(PrivateSocketDir::Create(::testing::TempDir(), "").ok());
  EXPECT_EQ(PrivateSocketDir::Create("/tmp", std::string(120, 's')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PrivateSocketDir::Create("/nonexistent/dir", "s").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LocalSocketTest, AcceptsOnlyTheDescribedSocketOnThisHost) {
  auto made = PrivateSocketDir::Create("/tmp", "s");
  ASSERT_TRUE(made.ok()) << made.status();
  const std::string path = made->socket_path();
  EXPECT_FALSE(SocketInode(path).ok());  // not bound yet
  int fd = BindUnixSocket(path);
  ASSERT_GE(fd, 0);
  auto inode = SocketInode(path);
  ASSERT_TRUE(inode.ok()) << inode.status();
  EXPECT_TRUE(CheckSameHostSocket(path, BootId(), *inode).ok());
  EXPECT_FALSE(CheckSameHostSocket(path, "00000000-0000-0000-0000-000000000000", *inode).ok());
  EXPECT_FALSE(CheckSameHostSocket(path, BootId(), *inode + 1).ok());
  EXPECT_FALSE(CheckSameHostSocket(made->dir() + "/missing", BootId(), *inode).ok());
  // A regular file where the socket was described is not it.
  const std::string file = made->dir() + "/file";
  std::ofstream(file) << "x";
  struct stat st;
  ASSERT_EQ(stat(file.c_str(), &st), 0);
  auto not_socket = CheckSameHostSocket(file, BootId(), st.st_ino);
  EXPECT_FALSE(not_socket.ok());
  EXPECT_NE(not_socket.message().find("not a socket"), std::string::npos) << not_socket;
  EXPECT_FALSE(SocketInode(file).ok());
  unlink(file.c_str());
  close(fd);
}

// A directory as PrivateSocketDir makes them, under `parent`.
std::string MakeSocketDir(const std::string& parent, const std::string& suffix) {
  const std::string dir = parent + "/shardgemm-" + suffix;
  EXPECT_EQ(mkdir(dir.c_str(), 0700), 0) << dir;
  return dir;
}

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

TEST(LocalSocketTest, RemovesOnlyTheDirectoriesOfSocketsNothingListensOn) {
  char templ[] = "/tmp/stale_socket_test_XXXXXX";
  ASSERT_NE(mkdtemp(templ), nullptr);
  const std::string parent = templ;
  // A killed server's: its socket bound, nothing listening.
  const std::string stale = MakeSocketDir(parent, "aaaaaa");
  int fd = BindUnixSocket(stale + "/worker.sock");
  ASSERT_GE(fd, 0);
  close(fd);
  // A live server's: listening.
  const std::string live = MakeSocketDir(parent, "bbbbbb");
  const int listening = BindUnixSocket(live + "/worker.sock");
  ASSERT_GE(listening, 0);
  ASSERT_EQ(listen(listening, 4), 0);
  // Something else beside a dead socket: not ours to judge.
  const std::string other = MakeSocketDir(parent, "cccccc");
  fd = BindUnixSocket(other + "/worker.sock");
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(other + "/notes.txt") << "keep";
  // Another name, or another socket name: left alone.
  const std::string foreign = parent + "/shardgemm-data";
  ASSERT_EQ(mkdir(foreign.c_str(), 0700), 0);
  const std::string other_socket = MakeSocketDir(parent, "dddddd");
  fd = BindUnixSocket(other_socket + "/client.sock");
  ASSERT_GE(fd, 0);
  close(fd);
  // An empty one (a server killed between mkdtemp and bind).
  const std::string empty = MakeSocketDir(parent, "eeeeee");

  // Too young: a server may be between binding and listening.
  EXPECT_EQ(RemoveStaleSocketDirs(parent, "worker.sock", absl::Hours(1)), 0);
  EXPECT_TRUE(Exists(stale));
  EXPECT_TRUE(Exists(empty));

  EXPECT_EQ(RemoveStaleSocketDirs(parent, "worker.sock", absl::ZeroDuration()), 2);
  EXPECT_FALSE(Exists(stale));
  EXPECT_FALSE(Exists(empty));
  EXPECT_TRUE(Exists(live + "/worker.sock"));
  EXPECT_TRUE(Exists(other + "/worker.sock"));
  EXPECT_TRUE(Exists(foreign));
  EXPECT_TRUE(Exists(other_socket + "/client.sock"));
  close(listening);
  EXPECT_EQ(RemoveStaleSocketDirs("/nonexistent/parent", "worker.sock", absl::ZeroDuration()), 0);
}

TEST(LocalSocketTest, ClaimsAFreePathOrAStaleSocketOnly) {
  char templ[] = "/tmp/claim_socket_test_XXXXXX";
  ASSERT_NE(mkdtemp(templ), nullptr);
  const std::string dir = templ;
  // Nothing there: free.
  EXPECT_TRUE(ClaimSocketPath(dir + "/free.sock", "client_socket").ok());
  // A killed server's socket: removed.
  const std::string stale = dir + "/stale.sock";
  int fd = BindUnixSocket(stale);
  ASSERT_GE(fd, 0);
  close(fd);
  ASSERT_TRUE(Exists(stale));
  EXPECT_TRUE(ClaimSocketPath(stale, "client_socket").ok());
  EXPECT_FALSE(Exists(stale));
  // A live server's: refused, and left in place.
  const std::string live = dir + "/live.sock";
  const int listening = BindUnixSocket(live);
  ASSERT_GE(listening, 0);
  ASSERT_EQ(listen(listening, 4), 0);
  absl::Status s = ClaimSocketPath(live, "client_socket").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("another process serves"), std::string::npos) << s;
  EXPECT_TRUE(Exists(live));
  close(listening);
  // A regular file: never removed.
  const std::string file = dir + "/notes.txt";
  std::ofstream(file) << "keep";
  s = ClaimSocketPath(file, "client_socket").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("not a socket"), std::string::npos) << s;
  EXPECT_TRUE(Exists(file));
  // Relative, empty and over-long paths name the flag.
  for (const std::string& bad : {std::string("relative.sock"), std::string(), "/" + std::string(200, 'x')}) {
    s = ClaimSocketPath(bad, "client_socket").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("client_socket"), std::string::npos) << s;
  }
  // Held: a second server on the same path is refused until the first lets go.
  {
    auto first = ClaimSocketPath(dir + "/free.sock", "client_socket");
    ASSERT_TRUE(first.ok()) << first.status();
    s = ClaimSocketPath(dir + "/free.sock", "client_socket").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("another server holds"), std::string::npos) << s;
  }
  EXPECT_TRUE(ClaimSocketPath(dir + "/free.sock", "client_socket").ok());
  unlink((dir + "/free.sock.lock").c_str());
  unlink((stale + ".lock").c_str());
  unlink((live + ".lock").c_str());
  // A directory others may write: another user could have bound the path.
  ASSERT_EQ(chmod(dir.c_str(), 0777), 0);
  s = ClaimSocketPath(dir + "/free.sock", "client_socket").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("no one else can write"), std::string::npos) << s;
  ASSERT_EQ(chmod(dir.c_str(), 0755), 0);
  EXPECT_TRUE(ClaimSocketPath(dir + "/free.sock", "client_socket").ok());
  s = ClaimSocketPath(file + "/x.sock", "client_socket").status();  // under a file
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  unlink(file.c_str());
  unlink(live.c_str());
  unlink((dir + "/free.sock.lock").c_str());
  unlink((file + ".lock").c_str());
  EXPECT_EQ(rmdir(dir.c_str()), 0) << "left behind in " << dir;
}

TEST(LocalSocketTest, ParsesOctalModesThatKeepTheOwnersAccess) {
  EXPECT_EQ(*ParseSocketMode("0600", "m"), 0600u);
  EXPECT_EQ(*ParseSocketMode("660", "m"), 0660u);
  EXPECT_EQ(*ParseSocketMode("0777", "m"), 0777u);
  for (const char* bad : {"", "0800", "abc", "06000", "-600", "0400", "0000"}) {
    auto mode = ParseSocketMode(bad, "client_socket_mode");
    ASSERT_FALSE(mode.ok()) << bad;
    EXPECT_EQ(mode.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(mode.status().message().find("client_socket_mode"), std::string::npos) << mode.status();
  }
}

}  // namespace
}  // namespace shardgemm::platform
