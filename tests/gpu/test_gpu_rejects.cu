// The CUDA backend refuses every bad-params case with exactly the CPU backend's message.
// Without a CUDA device these tests report as skipped.
#include <gtest/gtest.h>

#include "bad_params.h"
#include "gradcomp/cuda.h"

namespace gradcomp {
namespace {

TEST(GpuRejects, CudaBackendRefusesWhatTheCpuBackendRefusesWithTheSameMessage) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device on this machine";
  auto cpu = make_cpu_backend();
  auto gpu = cuda::make_cuda_backend();
  std::vector<float> data(testing::kBadParamsNumel);
  std::vector<uint8_t> payload(testing::bad_params_payload_bytes()), workspace(1 << 16);
  const testing::BadParamsMemory host{data.data(), payload.data(), workspace.data()};
  void *d_data = nullptr, *d_payload = nullptr, *d_workspace = nullptr;
  GRADCOMP_CUDA_CHECK(cudaMalloc(&d_data, data.size() * 4));
  GRADCOMP_CUDA_CHECK(cudaMalloc(&d_payload, payload.size()));
  GRADCOMP_CUDA_CHECK(cudaMalloc(&d_workspace, workspace.size()));
  const testing::BadParamsMemory device{d_data, static_cast<uint8_t*>(d_payload), d_workspace};
  for (const testing::BadParamsCase& c : testing::bad_params_cases()) {
    const std::string on_cpu = testing::rejection(c, *cpu, host);
    const std::string on_gpu = testing::rejection(c, *gpu, device);
    EXPECT_FALSE(on_gpu.empty()) << c.name << ": accepted by the CUDA backend";
    EXPECT_EQ(on_cpu, on_gpu) << c.name;
  }
  EXPECT_EQ(gpu->take_nonfinite_buckets(), 0u);  // nothing was launched, nothing failed
  cudaFree(d_data);
  cudaFree(d_payload);
  cudaFree(d_workspace);
}

TEST(GpuRejects, Q2IsRefusedByNameOnCuda) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device on this machine";
  cuda::CudaBackendOptions o;
  o.kernels = KernelGeneration::kV1;  // q2's kernels are v2's only
  auto gpu = cuda::make_cuda_backend(o);
  Q4EncodeParams e;
  e.codec = format::kCodecQ2;
  try {
    gpu->q4_encode(e);
    ADD_FAILURE() << "the CUDA backend took a q2 encode";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("Q2 on CUDA runs only on the v2 kernels"),
              std::string::npos)
        << err.what();
  }
}

}  // namespace
}  // namespace gradcomp
