// The CPU backend refuses every bad-params case with its rule's message; top-k takes k = 0.
#include <gtest/gtest.h>

#include <cmath>

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

// The scan flags a NaN or an infinity in any segment and dtype, and nothing in finite values.
TEST(BackendRejects, NonFiniteScanFlagsWhatADecoderWould) {
  auto backend = make_cpu_backend();
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (float bad : {0.0f, NAN, INFINITY, -INFINITY}) {
      HostTensor a = HostTensor::from_floats(dtype, testing::normal_floats(300, 1));
      HostTensor b = HostTensor::from_floats(dtype, testing::normal_floats(5000, 2));
      if (bad != 0.0f) b.set(4999, bad);
      Segment segs[2] = {a.segment(), b.segment()};
      segs[1].offset = 300;
      NonfiniteScanParams p;
      p.segments = segs;
      p.num_segments = 2;
      p.dtype = static_cast<uint8_t>(dtype);
      p.numel = 5300;
      backend->scan_nonfinite(p);
      EXPECT_EQ(backend->take_decode_status(), bad != 0.0f) << dtype_name(dtype) << " " << bad;
    }
  }
}

}  // namespace
}  // namespace gradcomp
