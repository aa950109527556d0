// The v2 CUDA reduce-scatter that never waits for the device inside a call (issue 35), q4 and
// top-k: bytes equal to the CPU reduce-scatter's over rounds with error feedback and a poisoned
// round, and a corrupt payload found by a later call or flush(), named, with the CPU's state.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "gradcomp/reduce_scatter.h"
#include "run_ranks.h"

namespace gradcomp {

// ctest's names of the codec cases (gtest_discover_tests takes the printed parameter); here, where
// argument-dependent lookup finds it for gradcomp::Codec.
static void PrintTo(Codec c, std::ostream* os) {
  *os << (c == Codec::kQ4 ? "Q4" : "TopK");
}

namespace {

using testing::HostTensor;

// A rank of an in-process group; with `device` its buffers are device memory and the bytes go
// through the host (as Gloo's do) after the device has finished writing them. On the chosen
// all_to_all call it flips a byte in the body of what it received from rank `corrupt_from`.
class Staged final : public Communicator {
 public:
  Staged(Communicator& host, bool device) : host_(host), device_(device) {}
  int rank() const override { return host_.rank(); }
  int world_size() const override { return host_.world_size(); }
  bool device_memory() const override { return device_; }
  int corrupt_call = -1;
  int corrupt_from = 1;

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes) override {
    const size_t total = bytes * static_cast<size_t>(world_size());
    std::vector<uint8_t> s(total), r(total);
    to_host(s.data(), send, total);
    host_.all_to_all(s.data(), r.data(), bytes);
    if (calls_++ == corrupt_call) r[bytes * (corrupt_from + 1) - 3] ^= 0x10;
    from_host(recv, r.data(), total);
  }
  void run_all_gather(const void* send, void* recv, size_t bytes) override {
    const size_t total = bytes * static_cast<size_t>(world_size());
    std::vector<uint8_t> s(bytes), r(total);
    to_host(s.data(), send, bytes);
    host_.all_gather(s.data(), r.data(), bytes);
    from_host(recv, r.data(), total);
  }
  void run_allreduce_mean(void*, int64_t, DType) override {
    GRADCOMP_CHECK(false, "not used by the reduce-scatter");
  }
  void run_reduce_scatter_mean(const void*, void*, int64_t, DType) override {
    GRADCOMP_CHECK(false, "not used by the reduce-scatter");
  }

 private:
  void to_host(void* dst, const void* src, size_t bytes) {
    if (!device_) return void(std::memcpy(dst, src, bytes));
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
    GRADCOMP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }
  void from_host(void* dst, const void* src, size_t bytes) {
    if (!device_) return void(std::memcpy(dst, src, bytes));
    GRADCOMP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  Communicator& host_;
  bool device_;
  int calls_ = 0;
};

// One rank's reduce-scatter on the CPU or on the v2 CUDA backend, host vectors in and out.
struct Rank {
  Rank(Communicator& host, bool gpu, const CompressionConfig& config)
      : comm(host, gpu),
        backend(gpu ? backend_of(KernelGeneration::kV2) : make_cpu_backend()),
        rs(comm, *backend, config),
        gpu(gpu) {}
  // Reduces `x` (world rows) of `dtype` into `y` (one row; its bytes are the output's start).
  bool call(const HostTensor& x, HostTensor& y, uint64_t bucket, float divisor) {
    const ReduceScatterRequest r0{nullptr, nullptr, y.numel, y.dtype, bucket, divisor};
    if (!gpu) {
      ReduceScatterRequest r = r0;
      r.input = x.bytes.data();
      r.output = y.bytes.data();
      return rs.reduce_scatter(r);
    }
    DeviceBuffer dx(x.bytes.data(), x.bytes.size());
    DeviceBuffer dy(y.bytes.data(), y.bytes.size());
    ReduceScatterRequest r = r0;
    r.input = dx.get();
    r.output = dy.get();
    const bool finite = rs.reduce_scatter(r);
    y.bytes = dy.host();
    return finite;
  }
  Staged comm;
  std::unique_ptr<Backend> backend;
  CompressedReduceScatter rs;
  bool gpu;
};

CompressionConfig v2_config(Codec codec) {
  CompressionConfig config;
  config.seed = 11;
  config.kernels = KernelGeneration::kV2;
  config.codec = codec;
  config.topk.ratio = 0.05;
  return config;
}

// Every case runs with each codec whose reduce-scatter the device decides.
class GpuReduceScatterNoWait : public ::testing::TestWithParam<Codec> {};

// Rank `rank`'s input of round `round`: normal values, with an infinity or a NaN on rank 1 in the
// poisoned round (late in its input, so that only the flag carries it to the other rows).
HostTensor input_of(DType dtype, int rank, int round, int64_t numel, int poisoned_round) {
  std::vector<float> v = testing::normal_floats(numel, 100 * rank + round);
  if (round == poisoned_round && rank == 1) v[numel - 2] = round % 2 ? NAN : INFINITY;
  return HostTensor::from_floats(dtype, v);
}

// Every rank's output and residual, per round, from the CPU and from the v2 CUDA reduce-scatter.
TEST_P(GpuReduceScatterNoWait, V2EqualsTheCpuOverRoundsWithErrorFeedbackAndPoison) {
  SKIP_WITHOUT_GPU();
  const int world = 3, rounds = 4, poisoned_round = 2;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int64_t shard : {int64_t{1}, int64_t{1000}, int64_t{4099}}) {
      std::vector<std::vector<uint8_t>> out[2][world];
      int nonfinite[2][world] = {};
      CompressionState state[2][world];
      for (int gpu = 0; gpu < 2; ++gpu) {
        InProcessGroup group(world);
        testing::run_ranks(group, [&](int rank, Communicator& host) {
          Rank me(host, gpu != 0, v2_config(GetParam()));
          for (int round = 0; round < rounds; ++round) {
            HostTensor x = input_of(dtype, rank, round, shard * world, poisoned_round);
            HostTensor y(dtype, shard);
            me.call(x, y, 5, static_cast<float>(world));
            out[gpu][rank].push_back(y.bytes);
          }
          me.rs.flush();
          // Counted at the call (the CPU) or when its verdict was read (v2 on CUDA).
          nonfinite[gpu][rank] = static_cast<int>(me.rs.nonfinite_buckets());
          state[gpu][rank] = me.rs.state();
        });
      }
      for (int rank = 0; rank < world; ++rank) {
        EXPECT_EQ(nonfinite[0][rank], 1) << "the CPU: the poisoned round is non-finite everywhere";
        EXPECT_EQ(nonfinite[1][rank], 1) << dtype_name(dtype) << " shard " << shard;
        for (int round = 0; round < rounds; ++round) {
          EXPECT_EQ(out[1][rank][round], out[0][rank][round])
              << dtype_name(dtype) << " shard " << shard << " rank " << rank << " round " << round
              << ": " << first_difference(out[1][rank][round], out[0][rank][round]);
        }
        EXPECT_EQ(state[1][rank].step, state[0][rank].step);
        EXPECT_EQ(state[1][rank].residuals, state[0][rank].residuals)
            << dtype_name(dtype) << " shard " << shard << " rank " << rank;
      }
    }
  }
}

// Rank 0 receives a corrupt payload from rank 1 in round 1. The CPU raises in that call; the v2
// CUDA call returns, writes no output, keeps the residual, and the error (bucket and sender)
// comes from flush() or from the next call of the bucket, which queues nothing. Afterwards both
// redo the round: the same step, output bytes and residuals as the CPU.
TEST_P(GpuReduceScatterNoWait, ACorruptPayloadIsRaisedByNameLaterWithTheCpusState) {
  SKIP_WITHOUT_GPU();
  const int world = 2;
  const int64_t shard = 700;
  const DType dtype = DType::kFloat32;
  for (bool by_flush : {true, false}) {
    std::vector<std::vector<uint8_t>> out[2][world];
    std::string message[2];
    CompressionState state[2][world];
    for (int gpu = 0; gpu < 2; ++gpu) {
      InProcessGroup group(world);
      testing::run_ranks(group, [&](int rank, Communicator& host) {
        Rank me(host, gpu != 0, v2_config(GetParam()));
        if (rank == 0) me.comm.corrupt_call = 1;
        for (int round = 0; round < 3; ++round) {
          HostTensor x = input_of(dtype, rank, round, shard * world, -1);
          HostTensor y = HostTensor::from_floats(dtype, std::vector<float>(shard, 42.0f));
          try {
            me.call(x, y, 5, 2.0f);
            if (gpu != 0 && rank == 0 && round == 1) {
              out[gpu][rank].push_back(y.bytes);  // what the rejected call left
              if (by_flush) {
                me.rs.flush();
              } else {
                me.call(x, y, 5, 2.0f);
              }
              ADD_FAILURE() << "the rejection was not raised";
            }
          } catch (const PayloadError& e) {
            EXPECT_TRUE(rank == 0 && round == 1) << e.what();
            message[gpu] = e.what();
            if (gpu == 0) out[gpu][rank].push_back(y.bytes);
            continue;
          }
          out[gpu][rank].push_back(y.bytes);
        }
        me.rs.flush();  // nothing left to raise
        state[gpu][rank] = me.rs.state();
      });
    }
    // The host path's message names the sender (its bucket is the call that raised); the later
    // error names the bucket too.
    EXPECT_NE(message[0].find("from rank 1"), std::string::npos) << message[0];
    EXPECT_NE(message[1].find("bucket 5 on rank 0"), std::string::npos) << message[1];
    EXPECT_NE(message[1].find("from rank 1"), std::string::npos) << message[1];
    const HostTensor marker = HostTensor::from_floats(dtype, std::vector<float>(shard, 42.0f));
    EXPECT_EQ(out[1][0][1], marker.bytes) << "output written from a rejected payload";
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_EQ(out[1][rank].size(), 3u);
      for (int round = 0; round < 3; ++round)
        EXPECT_EQ(out[1][rank][round], out[0][rank][round])
            << (by_flush ? "flush" : "next call") << " rank " << rank << " round " << round << ": "
            << first_difference(out[1][rank][round], out[0][rank][round]);
      EXPECT_EQ(state[1][rank].step, state[0][rank].step) << "rank " << rank;
      EXPECT_EQ(state[1][rank].residuals, state[0][rank].residuals) << "rank " << rank;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, GpuReduceScatterNoWait,
                         ::testing::Values(Codec::kQ4, Codec::kTopK),
                         [](const ::testing::TestParamInfo<Codec>& info) {
                           return info.param == Codec::kQ4 ? "Q4" : "TopK";
                         });

}  // namespace
}  // namespace gradcomp
