// The CPU backend refuses every bad-params case with its rule's message; top-k takes k = 0.
#include <gtest/gtest.h>

#include "bad_params.h"
#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

TEST(BackendRejects, CpuBackendRefusesEachBadParamsCase) {
  auto backend = make_cpu_backend();
  std::vector<float> data(testing::kBadParamsNumel);
  std::vector<uint8_t> payload(testing::bad_params_payload_bytes()), workspace(1 << 16);
  const testing::BadParamsMemory memory{data.data(), payload.data(), workspace.data()};
  for (const testing::BadParamsCase& c : testing::bad_params_cases()) {
    const std::string message = testing::rejection(c, *backend, memory);
    EXPECT_NE(message.find(c.expect), std::string::npos) << c.name << ": '" << message << "'";
  }
}

TEST(BackendRejects, TopKWithKZeroSelectsNothingAndKeepsEverythingAsResidual) {
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(500, 8));
  const std::vector<float> r = testing::normal_floats(500, 9, 0.1f);
  auto enc = testing::topk_encode_tensor(x, 0, 0, true, DType::kFloat32, r);
  EXPECT_EQ(enc.count, 0u);
  for (int64_t i = 0; i < 500; ++i)
    ASSERT_TRUE(testing::same_bits(enc.residual[i], x.get(i) + r[i])) << i;
}

}  // namespace
}  // namespace gradcomp
