// gradcomp-bench collective: compressed allreduce against NCCL's on the GPUs of one machine.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cli.h"
#include "gradcomp/gradcomp.h"
#if defined(GRADCOMP_HAVE_NCCL)
#include <nccl.h>

#include "gradcomp/nccl_communicator.h"
#endif

namespace gradcomp_bench {

using namespace gradcomp;

int collective_mode(const Args& a) {
#if defined(GRADCOMP_HAVE_NCCL)
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1)
    fail("collective mode needs CUDA GPUs; none found");
  const auto sizes = numbers(a, "--sizes", "1e6,1e7,1e8", 1, 2e9);
  const int reps = static_cast<int>(numbers(a, "--reps", "5", 1, 1000)[0]);
  std::vector<int> devs(gpus);
  for (int i = 0; i < gpus; ++i) devs[i] = i;
  std::vector<ncclComm_t> comms(gpus);
  GRADCOMP_NCCL_CHECK(ncclCommInitAll(comms.data(), gpus, devs.data()));
  std::printf("%-10s %-14s %10s %10s %10s\n", "elements", "method", "time us", "algbw GB/s",
              "busbw GB/s");
  for (double s : sizes) {
    const int64_t n = static_cast<int64_t>(s);
    for (const char* method : {"nccl-fp32", "nccl-bf16", "gradcomp-q4"}) {
      std::vector<double> times(gpus);
      std::vector<std::thread> threads;
      for (int g = 0; g < gpus; ++g) {
        threads.emplace_back([&, g] {
          GRADCOMP_CUDA_CHECK(cudaSetDevice(g));
          cudaStream_t stream;
          GRADCOMP_CUDA_CHECK(cudaStreamCreate(&stream));
          const bool bf16 = std::strcmp(method, "nccl-bf16") == 0;
          void* buf = nullptr;
          GRADCOMP_CUDA_CHECK(cudaMalloc(&buf, n * (bf16 ? 2 : 4)));
          GRADCOMP_CUDA_CHECK(cudaMemset(buf, 0, n * (bf16 ? 2 : 4)));
          std::vector<double> t;
          NcclCommunicator comm(comms[g], stream);
          cuda::CudaBackendOptions o;
          o.device = g;
          o.stream = stream;
          auto backend = cuda::make_cuda_backend(o);
          CompressedAllreduce engine(comm, *backend, CompressionConfig{});
          Segment seg{buf, 0, n};
          for (int r = 0; r < reps + 1; ++r) {
            GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto t0 = std::chrono::steady_clock::now();
            if (std::strcmp(method, "gradcomp-q4") == 0) {
              engine.allreduce(&seg, 1, DType::kFloat32, 0);
            } else {
              GRADCOMP_NCCL_CHECK(ncclAllReduce(buf, buf, n, bf16 ? ncclBfloat16 : ncclFloat32,
                                                ncclSum, comms[g], stream));
            }
            GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream));
            if (r > 0) t.push_back(seconds_since(t0));
          }
          times[g] = median(t);
          cudaFree(buf);
          cudaStreamDestroy(stream);
        });
      }
      for (auto& t : threads) t.join();
      const double time = *std::max_element(times.begin(), times.end());
      const double algbw = n * 4.0 / time / 1e9;  // fp32 gradient bytes averaged per second
      std::printf("%-10lld %-14s %10.1f %10.2f %10.2f\n", static_cast<long long>(n), method,
                  time * 1e6, algbw, algbw * 2.0 * (gpus - 1) / gpus);
    }
  }
  for (auto c : comms) ncclCommDestroy(c);
  (void)a.json;
  return 0;
#else
  (void)a;
  fail("collective mode needs a CUDA build with NCCL");
#endif
}

}  // namespace gradcomp_bench
