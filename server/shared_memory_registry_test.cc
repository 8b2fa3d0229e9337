#include "server/shared_memory_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace shardgemm {
namespace {

class SharedMemoryRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    key_ = absl::StrCat("/shardgemm_registry_test_", getpid());
    const int fd = shm_open(key_.c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 1024), 0);
    close(fd);
  }
  void TearDown() override { shm_unlink(key_.c_str()); }
  v1::RegisterSharedMemoryRequest Request(const std::string& name, uint64_t bytes) const {
    v1::RegisterSharedMemoryRequest r;
    r.set_name(name);
    r.set_key(key_);
    r.set_byte_size(bytes);
    return r;
  }
  static v1::SharedMemoryRef Ref(const std::string& region, uint64_t offset, uint64_t bytes) {
    v1::SharedMemoryRef r;
    r.set_region(region);
    r.set_offset(offset);
    r.set_byte_size(bytes);
    return r;
  }
  std::string key_;
};

TEST_F(SharedMemoryRegistryTest, ARegionResolvesForItsTenantOnlyAndWithinItsBounds) {
  SharedMemoryRegistry registry;
  ASSERT_TRUE(registry.Register("a", Request("in", 1000)).ok());
  auto region = registry.Resolve("a", Ref("in", 200, 800), 800, "lhs.shared_memory");
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(region->key, key_);
  EXPECT_EQ(registry.Resolve("b", Ref("in", 0, 8), 8, "lhs.shared_memory").status().code(),
            absl::StatusCode::kNotFound) << "another tenant's";
  auto past = registry.Resolve("a", Ref("in", 201, 800), 800, "lhs.shared_memory");
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(past.status().message().find("lhs.shared_memory"), absl::string_view::npos) << past.status();
  EXPECT_EQ(registry.Resolve("a", Ref("in", 0, 8), 16, "lhs.shared_memory").status().code(),
            absl::StatusCode::kInvalidArgument) << "byte_size not the tensor's";
  EXPECT_EQ(registry.Resolve("a", Ref("in", ~uint64_t{0}, 8), 8, "f").status().code(),
            absl::StatusCode::kInvalidArgument) << "an offset that would wrap";
  ASSERT_TRUE(registry.Unregister("a", "in").ok());
  EXPECT_EQ(registry.Resolve("a", Ref("in", 0, 8), 8, "f").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Unregister("a", "in").code(), absl::StatusCode::kNotFound);
}

TEST_F(SharedMemoryRegistryTest, BadRegistrationsSayWhy) {
  SharedMemoryRegistry registry(/*max_regions_per_tenant=*/1);
  EXPECT_EQ(registry.Register("a", Request("big", 2048)).status().code(), absl::StatusCode::kInvalidArgument)
      << "larger than the object";
  v1::RegisterSharedMemoryRequest missing = Request("m", 8);
  missing.set_key("/shardgemm_no_such_region");
  EXPECT_EQ(registry.Register("a", missing).status().code(), absl::StatusCode::kNotFound);
  v1::RegisterSharedMemoryRequest bad_key = Request("k", 8);
  bad_key.set_key("no-slash");
  EXPECT_EQ(registry.Register("a", bad_key).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("a", Request("", 8)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("a", Request("z", 0)).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.Register("a", Request("one", 8)).ok());
  EXPECT_EQ(registry.Register("a", Request("one", 8)).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.Register("a", Request("two", 8)).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(registry.Register("b", Request("two", 8)).ok()) << "a limit per tenant";
}

// A CUDA allocation registers by its IPC handle (opened by the workers, so
// only its length is checked here) and resolves to blocks that name it.
TEST_F(SharedMemoryRegistryTest, ACudaRegionRegistersByItsHandleAndItsBlocksNameIt) {
  SharedMemoryRegistry registry;
  v1::RegisterSharedMemoryRequest r;
  r.set_name("dev");
  r.mutable_cuda()->set_ipc_handle(std::string(kCudaIpcHandleBytes, '\x07'));
  r.set_byte_size(4096);
  ASSERT_TRUE(registry.Register("t", r).ok());
  auto region = registry.Resolve("t", Ref("dev", 1024, 2048), 2048, "lhs.shared_memory");
  ASSERT_TRUE(region.ok()) << region.status();
  const v1::SharedMemoryBlock block = region->Block(1024);
  EXPECT_EQ(block.object_case(), v1::SharedMemoryBlock::kCuda);
  EXPECT_EQ(block.cuda().ipc_handle(), std::string(kCudaIpcHandleBytes, '\x07'));
  EXPECT_EQ(block.offset(), 1024u);
  EXPECT_EQ(block.region_bytes(), 4096u);
  EXPECT_EQ(registry.Resolve("t", Ref("dev", 3072, 2048), 2048, "lhs.shared_memory").status().code(),
            absl::StatusCode::kInvalidArgument);
  // A POSIX region's blocks name its key.
  ASSERT_TRUE(registry.Register("t", Request("host", 1024)).ok());
  auto host = registry.Resolve("t", Ref("host", 0, 8), 8, "lhs.shared_memory");
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->Block(0).object_case(), v1::SharedMemoryBlock::kKey);
  EXPECT_EQ(host->Block(0).key(), key_);
}

TEST_F(SharedMemoryRegistryTest, ACudaHandleOfTheWrongLengthOrAnEmptyRegionIsRefusedNamingTheField) {
  SharedMemoryRegistry registry;
  v1::RegisterSharedMemoryRequest r;
  r.set_name("dev");
  r.mutable_cuda()->set_ipc_handle("short");
  r.set_byte_size(64);
  absl::Status s = registry.Register("t", r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cuda.ipc_handle"), std::string::npos) << s;
  r.mutable_cuda()->set_ipc_handle(std::string(kCudaIpcHandleBytes, 'x'));
  r.set_byte_size(0);
  s = registry.Register("t", r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("byte_size"), std::string::npos) << s;
  EXPECT_EQ(registry.Resolve("t", Ref("dev", 0, 8), 8, "lhs.shared_memory").status().code(),
            absl::StatusCode::kNotFound);
}

// A leased region lapses unless renewed, and then frees its name and its
// place in the tenant's limit; one without a lease stays.
TEST_F(SharedMemoryRegistryTest, ALeaseLapsesUnlessRenewed) {
  SharedMemoryRegistry registry(/*max_regions_per_tenant=*/2);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  v1::RegisterSharedMemoryRequest leased = Request("leased", 8);
  leased.set_lease_ms(2000);
  auto expires = registry.Register("a", leased, t0);
  ASSERT_TRUE(expires.ok()) << expires.status();
  EXPECT_EQ(*expires, t0 + absl::Seconds(2));
  auto forever = registry.Register("a", Request("forever", 8), t0);
  ASSERT_TRUE(forever.ok());
  EXPECT_EQ(*forever, absl::InfiniteFuture());
  // Renewed at 1.5 s: held at 3 s, lapsed at 3.6 s.
  EXPECT_TRUE(registry.Renew("a", {"leased", "forever"}, t0 + absl::Milliseconds(1500)).empty());
  EXPECT_TRUE(registry.Resolve("a", Ref("leased", 0, 8), 8, "f", t0 + absl::Seconds(3)).ok());
  auto gone = registry.Resolve("a", Ref("leased", 0, 8), 8, "lhs.shared_memory", t0 + absl::Milliseconds(3600));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("lease"), std::string::npos) << gone.status();
  EXPECT_EQ(registry.Renew("a", {"leased", "forever", "never"}, t0 + absl::Seconds(4)),
            (std::vector<std::string>{"leased", "never"}));
  EXPECT_TRUE(registry.Resolve("a", Ref("forever", 0, 8), 8, "f", t0 + absl::Hours(48)).ok());
  // Its place in the limit of 2 is free again, and so is its name.
  EXPECT_TRUE(registry.Register("a", leased, t0 + absl::Seconds(5)).ok());
  // Another tenant cannot renew it.
  EXPECT_EQ(registry.Renew("b", {"leased"}, t0 + absl::Seconds(5)), (std::vector<std::string>{"leased"}));
}

TEST_F(SharedMemoryRegistryTest, ALeaseOutsideItsBoundsIsRefusedNamingTheField) {
  SharedMemoryRegistry registry;
  for (uint64_t ms : {uint64_t{1}, uint64_t{99}, uint64_t{8} * 24 * 3600 * 1000}) {
    v1::RegisterSharedMemoryRequest r = Request("r", 8);
    r.set_lease_ms(ms);
    absl::Status s = registry.Register("a", r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << ms;
    EXPECT_NE(s.message().find("lease_ms"), std::string::npos) << s;
  }
}

TEST_F(SharedMemoryRegistryTest, AnObjectIsGoneOnceNoRegionNamesItUnregisteredOrLapsed) {
  SharedMemoryRegistry registry;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  // Two names of one object (two tenants), and a CUDA allocation's handle under a lease.
  ASSERT_TRUE(registry.Register("a", Request("r", 8), t0).ok());
  ASSERT_TRUE(registry.Register("b", Request("r", 8), t0).ok());
  v1::RegisterSharedMemoryRequest cuda;
  cuda.set_name("c");
  cuda.set_byte_size(256);
  cuda.set_lease_ms(1000);
  cuda.mutable_cuda()->set_ipc_handle(std::string(kCudaIpcHandleBytes, '\x07'));
  ASSERT_TRUE(registry.Register("a", cuda, t0).ok());
  EXPECT_TRUE(registry.TakeGone(t0).empty());

  // One name gone: tenant b's region still names the object, so it stays open.
  ASSERT_TRUE(registry.Unregister("a", "r", t0).ok());
  EXPECT_TRUE(registry.TakeGone(t0).empty());
  ASSERT_TRUE(registry.Unregister("b", "r", t0).ok());
  SharedMemoryRegistry::GoneObjects gone = registry.TakeGone(t0);
  EXPECT_EQ(gone.keys, std::vector<std::string>{key_});
  EXPECT_TRUE(gone.cuda_ipc_handles.empty());
  EXPECT_TRUE(registry.TakeGone(t0).empty()) << "each object is said once";

  // The lease lapses unrenewed: found by the next TakeGone.
  EXPECT_TRUE(registry.TakeGone(t0 + absl::Milliseconds(999)).empty());
  gone = registry.TakeGone(t0 + absl::Seconds(1));
  EXPECT_TRUE(gone.keys.empty());
  EXPECT_EQ(gone.cuda_ipc_handles, std::vector<std::string>{std::string(kCudaIpcHandleBytes, '\x07')});

  // Registered again before the take: still named, so not gone.
  ASSERT_TRUE(registry.Register("a", Request("r", 8), t0).ok());
  ASSERT_TRUE(registry.Unregister("a", "r", t0).ok());
  ASSERT_TRUE(registry.Register("a", Request("again", 8), t0).ok());
  EXPECT_TRUE(registry.TakeGone(t0).empty());
}

}  // namespace
}  // namespace shardgemm
