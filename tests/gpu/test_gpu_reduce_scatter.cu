// The CUDA reduce-scatter's payload-rejection contract: output, residual and round untouched, and
// the error names the sending rank (issue 34 item 5; runs on the lent GPU via
// scripts/gpu_check.sh).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "gradcomp/cuda.h"
#include "gradcomp/reduce_scatter.h"

namespace gradcomp {
namespace {

// One rank whose collectives copy device memory to itself; the chosen all_to_all call flips a
// byte of what it received (a corrupted payload on the wire).
class DeviceLoopback final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  bool device_memory() const override { return true; }
  int corrupt_call = -1;

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes) override {
    ASSERT_EQ(cudaMemcpy(recv, send, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
    if (calls_++ != corrupt_call) return;
    uint8_t b = 0;
    uint8_t* at = static_cast<uint8_t*>(recv) + bytes - 3;  // inside the payload's body
    ASSERT_EQ(cudaMemcpy(&b, at, 1, cudaMemcpyDeviceToHost), cudaSuccess);
    b ^= 0x10;
    ASSERT_EQ(cudaMemcpy(at, &b, 1, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void run_all_gather(const void* send, void* recv, size_t bytes) override {
    ASSERT_EQ(cudaMemcpy(recv, send, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
  }
  void run_allreduce_mean(void*, int64_t, DType) override {}
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t n, DType d) override {
    ASSERT_EQ(
        cudaMemcpy(recv, send, static_cast<size_t>(n) * dtype_size(d), cudaMemcpyDeviceToDevice),
        cudaSuccess);
  }

 private:
  int calls_ = 0;
};

TEST(GpuReduceScatter, ABadPayloadLeavesOutputResidualAndRoundAloneAndNamesTheRank) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device on this machine";
  const int64_t shard = 300;
  DeviceLoopback comm;
  comm.corrupt_call = 1;  // the second reduce-scatter
  auto backend = cuda::make_cuda_backend();
  CompressionConfig config;
  config.seed = 3;
  CompressedReduceScatter rs(comm, *backend, config);
  std::vector<float> host(shard);
  for (int64_t i = 0; i < shard; ++i) host[i] = 0.01f * static_cast<float>(i % 17) - 0.07f;
  float *x = nullptr, *y = nullptr;
  ASSERT_EQ(cudaMalloc(&x, shard * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&y, shard * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(x, host.data(), shard * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(rs.reduce_scatter({x, y, shard, DType::kFloat32, 9, 1.0f}));
  const CompressionState before = rs.state();
  const std::vector<float> marker(shard, 42.0f);
  ASSERT_EQ(cudaMemcpy(y, marker.data(), shard * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  std::string message;
  try {
    rs.reduce_scatter({x, y, shard, DType::kFloat32, 9, 1.0f});
  } catch (const PayloadError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("from rank 0"), std::string::npos) << message;
  std::vector<float> out(shard);
  ASSERT_EQ(cudaMemcpy(out.data(), y, shard * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(out, marker) << "output written from a rejected payload";
  const CompressionState after = rs.state();
  EXPECT_EQ(after.residuals, before.residuals) << "the residual advanced on a rejected payload";
  EXPECT_EQ(after.step, before.step) << "the round advanced on a rejected payload";
  cudaFree(x);
  cudaFree(y);
}

}  // namespace
}  // namespace gradcomp
