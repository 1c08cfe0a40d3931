// compute/runtime/kernel_profile.hpp: the request for a kernel profile of some steps.
#include <gtest/gtest.h>

#include <stdexcept>

#include "compute/runtime/kernel_profile.hpp"

namespace troupe {

// TROUPE_KERNEL_PROFILE=FILE[:FIRST[:LAST]] (launch_info::kernel_profile): the steps
// default to 5..6; a malformed value, or a build without a kernel profiler (LibTorch 1.x or
// no CUDA), is refused before a run.
TEST(KernelProfile, RequestIsParsedOrRefused) {
  EXPECT_FALSE(parse_kernel_profile(""));
  EXPECT_NO_THROW(check_kernel_profile(""));
  auto r = parse_kernel_profile("/tmp/k.json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->path, "/tmp/k.json");
  EXPECT_EQ(r->first, 5);
  EXPECT_EQ(r->last, 6);
  r = parse_kernel_profile("k.json:3");
  EXPECT_EQ(r->first, 3);
  EXPECT_EQ(r->last, 3);
  r = parse_kernel_profile("k.json:2:9");
  EXPECT_EQ(r->first, 2);
  EXPECT_EQ(r->last, 9);
  if (kernel_profile::available()) EXPECT_NO_THROW(check_kernel_profile("k.json:2:9"));
  else EXPECT_THROW(check_kernel_profile("k.json:2:9"), std::invalid_argument);
  for (const char* bad : {":1:2", "k.json:x", "k.json:4:2", "k.json:-1", "k.json:1:2x"})
    EXPECT_THROW(parse_kernel_profile(bad), std::invalid_argument) << bad;
}

}  // namespace troupe
