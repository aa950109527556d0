// GPU tests of q4 in both kernel generations over every path the v2 kernels choose between: one
// aligned segment, one misaligned, several (edges inside spans), ranges that start past 0, every
// residual dtype and aliasing, block sizes, grids of one and a few blocks (the seal), W payloads.
// Payloads, residuals and outputs byte-equal to the CPU. Skipped without a device.
#include <gtest/gtest.h>

#include <string>

#include "block_cases.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

void check_q4_case(Backend& backend, const BlockCase& c) {
  check_block_case(backend, format::kCodecQ4, c);
}

TEST(GpuQ4, BothGenerationsEqualTheCpuOnEveryPath) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    SCOPED_TRACE(gen_name(g));
    auto backend = backend_of(g);
    for (DType dtype : kDtypes) {
      for (Layout layout : {Layout::kAligned, Layout::kMisaligned, Layout::kSplit}) {
        for (int64_t n : {0, 1, 255, 256, 257, 1000, 4099, 70001}) {
          check_q4_case(*backend, {dtype, DType::kFloat32, true, false, 64, 0, n, layout, true});
          check_q4_case(*backend, {dtype, DType::kBFloat16, true, true, 64, 128, n, layout, false});
        }
      }
      for (int block : {16, 32, 128, 256}) {
        for (DType rd : kDtypes) {
          check_q4_case(*backend,
                        {dtype, rd, true, false, block, 2 * block, 5000, Layout::kSplit, true});
          check_q4_case(*backend, {dtype, rd, true, true, block, 0, 4096, Layout::kAligned, true});
        }
        check_q4_case(*backend, {dtype, DType::kFloat32, false, false, block, 0, 3001,
                                 Layout::kMisaligned, false});
      }
    }
  }
}

// A grid of one block and of three: every block's checksum terms reach the header, and the one
// that finishes last seals it, whichever it is.
TEST(GpuQ4, BothGenerationsSealWithFewBlocks) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    for (int ctas : {1, 3}) {
      SCOPED_TRACE(std::string(gen_name(g)) + " ctas=" + std::to_string(ctas));
      cuda::CudaBackendOptions o;
      o.kernels = g;
      o.max_encode_ctas = ctas;
      auto backend = cuda::make_cuda_backend(o);
      for (int64_t n : {1, 2048, 100003})
        check_q4_case(*backend, {DType::kFloat32, DType::kFloat32, true, false, 64, 0, n,
                                 Layout::kAligned, true});
    }
  }
}

// The same bytes every time: the seal's order of atomic additions cannot change the sum.
TEST(GpuQ4, V2EncodeIsDeterministicAcrossRuns) {
  SKIP_WITHOUT_GPU();
  auto backend = backend_of(KernelGeneration::kV2);
  const int64_t n = (1 << 22) + 77;
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 5));
  DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dp(q4_payload_bytes(n, 64));
  Segment seg{dx.get(), 0, n};
  Q4EncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.numel = n;
  p.rng = {1, 2, 3, 4, 0};
  p.payload = dp.get();
  backend->q4_encode(p);
  const auto first = dp.host();
  for (int run = 0; run < 5; ++run) {
    backend->q4_encode(p);
    ASSERT_EQ(dp.host(), first) << "run " << run;
  }
  EXPECT_EQ(first, testing::q4_encode_tensor(x, 64, true, {1, 2, 3, 4, 0}).payload);
}

}  // namespace
}  // namespace gradcomp
