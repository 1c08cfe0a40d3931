// transport/nccl: a NCCL link between two ranks (the point-to-point channel between stages
// on GPUs of their own); without NCCL, or without its peer, making one fails clearly.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "compute/runtime/device.hpp"
#include "transport/nccl/nccl_communicator.hpp"

namespace troupe {

using namespace troupe::transport;
using namespace std::chrono_literals;

TEST(NcclLink, WithoutNcclOrAPeerMakingALinkFails) {
  if (!nccl_built()) {
    EXPECT_THROW(make_nccl_link(std::vector<char>(128), true, 0), transport_error);
    return;
  }
  if (troupe::cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  // Two GPUs make a link; one rank alone cannot (NCCL puts the two ranks of a link on two
  // GPUs, which the machines lent to this project never had): its creation times out.
  nccl_options o;
  o.timeout = 2s;
  try {
    make_nccl_link(nccl_unique_id(), true, 0, o);
    ADD_FAILURE() << "a link without its receiver was made";
  } catch (const transport_error& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
}

}  // namespace troupe
