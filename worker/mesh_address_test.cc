#include "worker/mesh_address.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardgemm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

// A host with loopback, one Ethernet interface with an IPv4 and an IPv6
// address, and a container bridge.
std::vector<NetInterface> Host() {
  return {{"lo", AF_INET, "127.0.0.1"},
          {"eth0", AF_INET, "10.0.0.6"},
          {"docker0", AF_INET, "172.17.0.1"},
          {"lo", AF_INET6, "::1"},
          {"eth0", AF_INET6, "fd00::6"}};
}

TEST(MeshAddressTest, LoopbackIsLo) {
  auto i = InterfaceForAddress("127.0.0.1", Host());
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(i->name, "lo");
  EXPECT_EQ(i->family, AF_INET);
  EXPECT_EQ(i->address, "127.0.0.1");
}

TEST(MeshAddressTest, TheInterfaceHoldingTheAddressNotTheFirstOne) {
  auto eth = InterfaceForAddress("10.0.0.6", Host());
  ASSERT_TRUE(eth.ok()) << eth.status();
  EXPECT_EQ(eth->name, "eth0");
  auto bridge = InterfaceForAddress("172.17.0.1", Host());
  ASSERT_TRUE(bridge.ok()) << bridge.status();
  EXPECT_EQ(bridge->name, "docker0");
}

TEST(MeshAddressTest, IPv6InAnySpelling) {
  for (const char* spelling : {"::1", "[::1]", "0:0:0:0:0:0:0:1"}) {
    auto i = InterfaceForAddress(spelling, Host());
    ASSERT_TRUE(i.ok()) << spelling << ": " << i.status();
    EXPECT_EQ(i->name, "lo");
    EXPECT_EQ(i->family, AF_INET6);
    EXPECT_EQ(i->address, "::1");
  }
  auto eth = InterfaceForAddress("fd00:0::6", Host());
  ASSERT_TRUE(eth.ok()) << eth.status();
  EXPECT_EQ(eth->name, "eth0");
  EXPECT_EQ(eth->family, AF_INET6);
}

TEST(MeshAddressTest, AnIPv4MappedAddressIsItsIPv4One) {
  auto i = InterfaceForAddress("::ffff:10.0.0.6", Host());
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(i->name, "eth0");
  EXPECT_EQ(i->family, AF_INET);
  EXPECT_EQ(i->address, "10.0.0.6");
}

TEST(MeshAddressTest, WildcardsAndNamesAreRefused) {
  for (const char* wildcard : {"0.0.0.0", "::", "[::]", "::ffff:0.0.0.0"}) {
    auto i = InterfaceForAddress(wildcard, Host());
    EXPECT_EQ(i.status().code(), absl::StatusCode::kInvalidArgument) << wildcard;
    EXPECT_THAT(i.status().message(), HasSubstr("wildcard")) << wildcard;
  }
  EXPECT_EQ(InterfaceForAddress("localhost", Host()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MeshAddressTest, AnAddressNoInterfaceHoldsIsNotFound) {
  auto i = InterfaceForAddress("10.0.0.7", Host());
  EXPECT_EQ(i.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(i.status().message(), HasSubstr("eth0 10.0.0.6"));  // says what there is
  EXPECT_EQ(InterfaceForAddress("127.0.0.1", {}).status().code(), absl::StatusCode::kNotFound);
}

TEST(MeshAddressTest, CanonicalAddress) {
  EXPECT_EQ(CanonicalAddress("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(CanonicalAddress("0:0::1"), "::1");
  EXPECT_EQ(CanonicalAddress("::ffff:127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(CanonicalAddress("0"), "");  // inet_aton would take it; a mesh host resolves it (below)
  EXPECT_EQ(CanonicalAddress("worker-0"), "");
  EXPECT_EQ(UnbracketHost("[::1]"), "::1");
  EXPECT_EQ(UnbracketHost("::1"), "::1");
  EXPECT_EQ(UnbracketHost("host"), "host");
}

TEST(MeshAddressTest, MeshHostLiterals) {
  auto v4 = MeshInterface("127.0.0.1", Host());
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(v4->name, "lo");
  auto v6 = MeshInterface("[::1]", Host());
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(v6->address, "::1");
  EXPECT_EQ(MeshInterface("10.9.9.9", Host()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MeshInterface("", Host()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MeshAddressTest, MeshHostsThatResolveToAWildcardAreRefused) {
  // "0" is 0.0.0.0 to the resolver: a listen on it would be every interface.
  for (const char* host : {"0", "0.0.0.0", "[::]", "::"}) {
    auto i = MeshInterface(host, Host());
    EXPECT_EQ(i.status().code(), absl::StatusCode::kInvalidArgument) << host << ": " << i.status();
    EXPECT_THAT(i.status().message(), HasSubstr("wildcard")) << host;
  }
}

TEST(MeshAddressTest, ANameResolvesToTheLocalAddress) {
  // localhost is 127.0.0.1 and/or ::1 by /etc/hosts: either is lo's.
  auto i = MeshInterface("localhost", Host());
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(i->name, "lo");
  EXPECT_EQ(MeshInterface("no-such-host.invalid", Host()).status().code(), absl::StatusCode::kUnavailable);
}

TEST(MeshAddressTest, ThisHostsLoopbackIsFound) {
  // getifaddrs here: every Linux host has lo with 127.0.0.1.
  auto i = MeshInterface("127.0.0.1", LocalInterfaces());
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(i->name, "lo");
}

const char* Unset(const char*) { return nullptr; }

TEST(MeshAddressTest, NcclIsPinnedToTheMeshInterface) {
  EXPECT_THAT(NcclSocketEnvironment({"lo", AF_INET, "127.0.0.1"}, Unset),
              ElementsAre(Pair("NCCL_SOCKET_IFNAME", "=lo"), Pair("NCCL_SOCKET_FAMILY", "AF_INET")));
  EXPECT_THAT(NcclSocketEnvironment({"eth0", AF_INET6, "fd00::6"}, Unset),
              ElementsAre(Pair("NCCL_SOCKET_IFNAME", "=eth0"), Pair("NCCL_SOCKET_FAMILY", "AF_INET6")));
}

TEST(MeshAddressTest, TheOperatorsChoiceIsKept) {
  std::map<std::string, std::string> env = {{"NCCL_SOCKET_IFNAME", "ib0"}};
  auto from = [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  EXPECT_THAT(NcclSocketEnvironment({"lo", AF_INET, "127.0.0.1"}, from), IsEmpty());
  env = {{"NCCL_SOCKET_FAMILY", "AF_INET6"}};  // the family alone: the interface is still ours to pick
  EXPECT_THAT(NcclSocketEnvironment({"lo", AF_INET, "127.0.0.1"}, from),
              ElementsAre(Pair("NCCL_SOCKET_IFNAME", "=lo")));
  env = {{"NCCL_SOCKET_IFNAME", ""}};  // set but empty: NCCL's default, so not a choice
  EXPECT_THAT(NcclSocketEnvironment({"lo", AF_INET, "127.0.0.1"}, from),
              ElementsAre(Pair("NCCL_SOCKET_IFNAME", "=lo"), Pair("NCCL_SOCKET_FAMILY", "AF_INET")));
}

}  // namespace
}  // namespace shardgemm
