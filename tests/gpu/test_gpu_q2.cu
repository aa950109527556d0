// GPU tests of q2 (its only CUDA kernels are v2's): payloads, residuals and decode-and-mean outputs
// byte-equal to the CPU reference over the v2 kernels' paths, corrupt payloads rejected by name,
// and v1 refusing q2 with the way in. Skipped without a device.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "block_cases.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

void check_q2_case(Backend& backend, const BlockCase& c) {
  check_block_case(backend, format::kCodecQ2, c);
}

// Every dtype, layout (one aligned segment, one misaligned, pieces with edges inside spans), size
// around the span and code-byte edges, residual dtype with and without aliasing, block size, and
// both roundings; a range starting past 0 moves the random stream's counter.
TEST(GpuQ2, V2EqualsTheCpuOnEveryPath) {
  SKIP_WITHOUT_GPU();
  auto backend = backend_of(KernelGeneration::kV2);
  for (DType dtype : kDtypes) {
    for (Layout layout : {Layout::kAligned, Layout::kMisaligned, Layout::kSplit}) {
      for (int64_t n : {0, 1, 3, 5, 255, 256, 257, 1000, 4099, 70001}) {
        check_q2_case(*backend, {dtype, DType::kFloat32, true, false, 64, 0, n, layout, true});
        check_q2_case(*backend, {dtype, DType::kBFloat16, true, true, 64, 128, n, layout, false});
      }
    }
    for (int block : {16, 32, 128, 256}) {
      for (DType rd : kDtypes) {
        check_q2_case(*backend,
                      {dtype, rd, true, false, block, 2 * block, 5001, Layout::kSplit, true});
        check_q2_case(*backend, {dtype, rd, true, true, block, 0, 4096, Layout::kAligned, true});
      }
      check_q2_case(*backend, {dtype, DType::kFloat32, false, false, block, 0, 3003,
                               Layout::kMisaligned, false});
    }
  }
}

// A grid of one block and of three: every block's checksum terms (half-words of codes and bf16
// scales) reach the header, and the block that finishes last seals it.
TEST(GpuQ2, V2SealsWithFewBlocks) {
  SKIP_WITHOUT_GPU();
  for (int ctas : {1, 3}) {
    SCOPED_TRACE("ctas=" + std::to_string(ctas));
    cuda::CudaBackendOptions o;
    o.kernels = KernelGeneration::kV2;
    o.max_encode_ctas = ctas;
    auto backend = cuda::make_cuda_backend(o);
    for (int64_t n : {1, 2048, 100003})
      check_q2_case(*backend, {DType::kFloat32, DType::kFloat32, true, false, 64, 0, n,
                               Layout::kAligned, true});
  }
}

// q2 payloads through the shared rejection check (gpu_test_util.h) on a v2 backend.
void expect_rejected(void (*corrupt)(std::vector<uint8_t>&), const char* what) {
  expect_corrupt_payload_rejected<PayloadError>(*backend_of(KernelGeneration::kV2),
                                                format::kCodecQ2, corrupt, what);
}

TEST(GpuQ2, CorruptPayloadsAreRejectedByName) {
  SKIP_WITHOUT_GPU();
  expect_rejected([](std::vector<uint8_t>& p) { p[p.size() - 40] ^= 0x04; }, "body checksum");
  expect_rejected([](std::vector<uint8_t>& p) { p[kPayloadHeaderBytes + 3] ^= 0x01; },
                  "body checksum");  // a bf16 scale
  expect_rejected([](std::vector<uint8_t>& p) { p[20] ^= 1; }, "header checksum");
}

// Under v1, q2 is refused before anything runs, naming the switch that lets it in.
TEST(GpuQ2, V1RefusesQ2NamingTheWayIn) {
  SKIP_WITHOUT_GPU();
  auto backend = backend_of(KernelGeneration::kV1);
  Q4EncodeParams e;
  e.codec = format::kCodecQ2;
  try {
    backend->q4_encode(e);
    ADD_FAILURE() << "v1 took a q2 encode";
  } catch (const Error& err) {
    const std::string what = err.what();
    EXPECT_NE(what.find("GRADCOMP_KERNELS=v2"), std::string::npos) << what;
    EXPECT_NE(what.find("kernels=\"v2\""), std::string::npos) << what;
  }
  backend->check_codec(format::kCodecQ4);
  backend_of(KernelGeneration::kV2)->check_codec(format::kCodecQ2);
}

}  // namespace
}  // namespace gradcomp
