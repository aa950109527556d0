// The cub::DeviceTopK peer of the exact top-k rows in bench_cuda.cu (built only when CMake found
// CCCL >= 3.3: the pinned nvidia-cuda-cccl headers, used for this file alone). k = 1 % of n
// largest |x|, unsorted, no error feedback and no payload: the figure the v2 exact target (at
// most 500 us per 1e8 with error feedback) is set against (1025 us on an H200, 2026-12-04).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cub/device/device_topk.cuh>
#include <cuda/iterator>
#include <random>
#include <vector>

namespace {

// |x| as an ordered key.
struct AbsKey {
  const float* x;
  __device__ unsigned operator()(long long i) const {
    return __float_as_uint(__ldg(x + i)) & 0x7FFFFFFFu;
  }
};

#define PEER_CHECK(call)                           \
  do {                                             \
    const cudaError_t e_ = (call);                 \
    if (e_ != cudaSuccess) {                       \
      state.SkipWithError(cudaGetErrorString(e_)); \
      return;                                      \
    }                                              \
  } while (0)

void BM_CubDeviceTopK(benchmark::State& state) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const long long n = state.range(0);
  const long long k = (n + 99) / 100;  // topk_k(n, 0.01)
  std::vector<float> host(static_cast<size_t>(n));
  std::mt19937 gen(1);
  std::normal_distribution<float> dist;
  for (auto& v : host) v = dist(gen);
  // Two copies alternate so that an iteration never finds its input in L2.
  float* x[2] = {nullptr, nullptr};
  unsigned* out = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  PEER_CHECK(cudaStreamCreate(&stream));
  PEER_CHECK(cudaEventCreate(&start));
  PEER_CHECK(cudaEventCreate(&stop));
  for (auto& p : x) {
    PEER_CHECK(cudaMalloc(&p, host.size() * 4));
    PEER_CHECK(cudaMemcpy(p, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  }
  PEER_CHECK(cudaMalloc(&out, static_cast<size_t>(k) * 4));
  auto env = ::cuda::std::execution::env{
      ::cuda::stream_ref{stream},
      ::cuda::execution::require(::cuda::execution::determinism::not_guaranteed,
                                 ::cuda::execution::output_ordering::unsorted)};
  auto keys = [&](int i) {
    return ::cuda::make_transform_iterator(::cuda::counting_iterator<long long>(0),
                                           AbsKey{x[i & 1]});
  };
  size_t temp_bytes = 0;
  PEER_CHECK(cub::DeviceTopK::MaxKeys(nullptr, temp_bytes, keys(0), out, n, k, env));
  void* temp = nullptr;
  PEER_CHECK(cudaMalloc(&temp, temp_bytes));
  for (int i = 0; i < 3; ++i)
    PEER_CHECK(cub::DeviceTopK::MaxKeys(temp, temp_bytes, keys(i), out, n, k, env));
  int i = 0;
  for (auto _ : state) {
    PEER_CHECK(cudaEventRecord(start, stream));
    PEER_CHECK(cub::DeviceTopK::MaxKeys(temp, temp_bytes, keys(i++), out, n, k, env));
    PEER_CHECK(cudaEventRecord(stop, stream));
    PEER_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    PEER_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms / 1e3);
  }
  state.SetBytesProcessed(static_cast<int64_t>(4.0 * n * state.iterations()));
  cudaFree(temp);
  cudaFree(out);
  for (auto* p : x) cudaFree(p);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
}

BENCHMARK(BM_CubDeviceTopK)
    ->ArgNames({"n"})
    ->Arg(100'000'000)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
