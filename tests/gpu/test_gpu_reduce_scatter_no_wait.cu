// The v2 CUDA reduce-scatter whose non-finite poison stays on the device (issue 35): bytes equal
// to the CPU reduce-scatter's over rounds with error feedback and a poisoned round.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gpu_test_util.h"
#include "gradcomp/reduce_scatter.h"
#include "run_ranks.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

// A rank of an in-process group whose buffers are device memory: the bytes go through the host
// (as Gloo's do), after the device has finished writing them.
class DeviceStaged final : public Communicator {
 public:
  explicit DeviceStaged(Communicator& host) : host_(host) {}
  int rank() const override { return host_.rank(); }
  int world_size() const override { return host_.world_size(); }
  bool device_memory() const override { return true; }

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes) override {
    const size_t total = bytes * static_cast<size_t>(world_size());
    std::vector<uint8_t> s(total), r(total);
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
    GRADCOMP_CUDA_CHECK(cudaMemcpy(s.data(), send, total, cudaMemcpyDeviceToHost));
    host_.all_to_all(s.data(), r.data(), bytes);
    GRADCOMP_CUDA_CHECK(cudaMemcpy(recv, r.data(), total, cudaMemcpyHostToDevice));
  }
  void run_all_gather(const void* send, void* recv, size_t bytes) override {
    const size_t total = bytes * static_cast<size_t>(world_size());
    std::vector<uint8_t> s(bytes), r(total);
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
    GRADCOMP_CUDA_CHECK(cudaMemcpy(s.data(), send, bytes, cudaMemcpyDeviceToHost));
    host_.all_gather(s.data(), r.data(), bytes);
    GRADCOMP_CUDA_CHECK(cudaMemcpy(recv, r.data(), total, cudaMemcpyHostToDevice));
  }
  void run_allreduce_mean(void*, int64_t, DType) override {
    GRADCOMP_CHECK(false, "not used by the reduce-scatter");
  }
  void run_reduce_scatter_mean(const void*, void*, int64_t, DType) override {
    GRADCOMP_CHECK(false, "not used by the reduce-scatter");
  }

 private:
  Communicator& host_;
};

// Rank `rank`'s input of round `round`: normal values, with an infinity or a NaN on rank 1 in the
// poisoned round (late in its input, so that only the flag carries it to the other rows).
std::vector<float> input_of(int rank, int round, int64_t numel, int poisoned_round) {
  std::vector<float> v = testing::normal_floats(numel, 100 * rank + round);
  if (round == poisoned_round && rank == 1) v[numel - 2] = round % 2 ? NAN : INFINITY;
  return v;
}

// Every rank's output and residual, per round, from the CPU and from the v2 CUDA reduce-scatter.
TEST(GpuReduceScatterNoWait, V2EqualsTheCpuOverRoundsWithErrorFeedbackAndPoison) {
  SKIP_WITHOUT_GPU();
  const int world = 3, rounds = 4, poisoned_round = 2;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int64_t shard : {int64_t{1}, int64_t{1000}, int64_t{4099}}) {
      CompressionConfig config;
      config.seed = 11;
      config.kernels = KernelGeneration::kV2;
      InProcessGroup cpu_group(world), gpu_group(world);
      std::vector<std::vector<std::vector<uint8_t>>> cpu_out(world), gpu_out(world);
      std::vector<std::vector<bool>> cpu_finite(world), gpu_finite(world);
      std::vector<CompressionState> cpu_state(world), gpu_state(world);
      testing::run_ranks(cpu_group, [&](int rank, Communicator& comm) {
        auto backend = make_cpu_backend();
        CompressedReduceScatter rs(comm, *backend, config);
        for (int round = 0; round < rounds; ++round) {
          HostTensor x =
              HostTensor::from_floats(dtype, input_of(rank, round, shard * world, poisoned_round));
          HostTensor y(dtype, shard);
          cpu_finite[rank].push_back(rs.reduce_scatter(
              {x.bytes.data(), y.bytes.data(), shard, dtype, 5, static_cast<float>(world)}));
          cpu_out[rank].push_back(y.bytes);
        }
        cpu_state[rank] = rs.state();
      });
      testing::run_ranks(gpu_group, [&](int rank, Communicator& host) {
        DeviceStaged comm(host);
        auto backend = backend_of(KernelGeneration::kV2);
        CompressedReduceScatter rs(comm, *backend, config);
        for (int round = 0; round < rounds; ++round) {
          HostTensor x =
              HostTensor::from_floats(dtype, input_of(rank, round, shard * world, poisoned_round));
          DeviceBuffer dx(x.bytes.data(), x.bytes.size());
          DeviceBuffer dy(shard * dtype_size(dtype));
          gpu_finite[rank].push_back(
              rs.reduce_scatter({dx.get(), dy.get(), shard, dtype, 5, static_cast<float>(world)}));
          gpu_out[rank].push_back(dy.host());
        }
        gpu_state[rank] = rs.state();
      });
      for (int rank = 0; rank < world; ++rank) {
        for (int round = 0; round < rounds; ++round) {
          EXPECT_EQ(cpu_finite[rank][round], round != poisoned_round)
              << "the CPU reference: every rank's output of the poisoned round is non-finite";
          EXPECT_EQ(gpu_finite[rank][round], cpu_finite[rank][round])
              << dtype_name(dtype) << " shard " << shard << " rank " << rank << " round " << round;
          EXPECT_EQ(gpu_out[rank][round], cpu_out[rank][round])
              << dtype_name(dtype) << " shard " << shard << " rank " << rank << " round " << round
              << ": " << first_difference(gpu_out[rank][round], cpu_out[rank][round]);
        }
        EXPECT_EQ(gpu_state[rank].step, cpu_state[rank].step);
        EXPECT_EQ(gpu_state[rank].residuals, cpu_state[rank].residuals)
            << dtype_name(dtype) << " shard " << shard << " rank " << rank;
      }
    }
  }
}

}  // namespace
}  // namespace gradcomp
