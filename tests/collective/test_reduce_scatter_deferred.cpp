// The host logic of the reduce-scatter whose verdicts the device keeps (v2 on CUDA, q4 and top-k),
// over a backend with the CUDA backend's status semantics and the CPU codecs: the same bytes,
// residuals and rounds as the host path, and a rejected payload raised by name later.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "gradcomp/format.h"
#include "gradcomp/forwarding_backend.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/reduce_scatter.h"
#include "run_ranks.h"
#include "test_util.h"

namespace gradcomp {

// ctest's names of the codec cases (gtest_discover_tests takes the printed parameter); here, where
// argument-dependent lookup finds it for gradcomp::Codec.
static void PrintTo(Codec c, std::ostream* os) {
  *os << (c == Codec::kQ4 ? "Q4" : "TopK");
}

namespace {

using testing::HostTensor;
using testing::run_ranks;

// The CUDA backend's status semantics over the CPU codecs: a rejected payload (by the payload
// check, or by the v2 top-k decode's own checks) sets a sticky status instead of raising, decodes
// then write nothing and end_bucket() keeps the committed residuals; reports come late (poll: a
// copy queued by one call, ready at a later poll when `ready` is set; take_nonfinite_buckets: at
// once, as after a wait).
class DeferredStatusBackend final : public ForwardingBackend {
 public:
  DeferredStatusBackend() : ForwardingBackend(make_cpu_backend()) {}
  bool ready = true;
  bool is_cuda() const override { return true; }
  void q4_decode(const Q4DecodeParams& p) override {
    if (status_.empty()) inner().q4_decode(p);
  }
  void topk_decode(const TopKDecodeParams& p) override {
    if (!status_.empty()) return;
    try {
      inner().topk_decode(p);
    } catch (const PayloadError& e) {
      status_ = e.what();
    }
  }
  void check_payloads(const PayloadCheckParams& p) override {
    if (!status_.empty()) return;
    try {
      inner().check_payloads(p);
    } catch (const PayloadError& e) {
      status_ = e.what();
    }
  }
  bool take_decode_status() override {
    ADD_FAILURE() << "the host waited for a decode's status";
    raise_status();
    return inner().take_decode_status();
  }
  void end_bucket(const ResidualPair* pairs, int count) override {
    if (!status_.empty()) {
      for (int i = 0; i < count; ++i)
        std::memcpy(pairs[i].candidate, pairs[i].committed, static_cast<size_t>(pairs[i].bytes));
    }
    inner().end_bucket(pairs, count);
  }
  uint64_t take_nonfinite_buckets() override {
    ++waits;
    uint64_t polled = 0;
    if (queued_) {
      const bool was = ready;
      ready = true;
      poll_nonfinite_buckets(&polled);
      ready = was;
    }
    raise_status();
    return polled + inner().take_nonfinite_buckets();
  }
  bool poll_nonfinite_buckets(uint64_t* count) override {
    *count = 0;
    if (!queued_) {
      queued_ = true;
      snapshot_status_ = status_;
      snapshot_count_ = inner().take_nonfinite_buckets();
      return false;
    }
    if (!ready) return false;
    queued_ = false;
    if (!snapshot_status_.empty()) {
      status_.clear();
      throw PayloadError("device: " + snapshot_status_);
    }
    *count = snapshot_count_;
    return true;
  }
  int waits = 0;

 private:
  void raise_status() {
    if (status_.empty()) return;
    const std::string s = status_;
    status_.clear();
    throw PayloadError("device: " + s);
  }
  std::string status_;
  std::string snapshot_status_;
  uint64_t snapshot_count_ = 0;
  bool queued_ = false;
};

// A rank's transport over host memory that says it is device memory (for the backend above, which
// says it is CUDA) or host memory (for the host path); on the chosen all_to_all call it flips a
// body byte of what came from rank 1.
class CorruptingTransport final : public Communicator {
 public:
  CorruptingTransport(Communicator& host, bool device_memory)
      : host_(host), device_memory_(device_memory) {}
  int rank() const override { return host_.rank(); }
  int world_size() const override { return host_.world_size(); }
  bool device_memory() const override { return device_memory_; }
  int corrupt_call = -1;

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes) override {
    host_.all_to_all(send, recv, bytes);
    if (calls_++ == corrupt_call) static_cast<uint8_t*>(recv)[2 * bytes - 3] ^= 0x10;
  }
  void run_all_gather(const void* send, void* recv, size_t bytes) override {
    host_.all_gather(send, recv, bytes);
  }
  void run_allreduce_mean(void*, int64_t, DType) override { FAIL() << "not used"; }
  void run_reduce_scatter_mean(const void*, void*, int64_t, DType) override {
    FAIL() << "not used";
  }

 private:
  Communicator& host_;
  const bool device_memory_;
  int calls_ = 0;
};

CompressionConfig v2_config(Codec codec) {
  CompressionConfig c;
  c.seed = 21;
  c.kernels = KernelGeneration::kV2;
  c.codec = codec;
  c.topk.ratio = 0.05;
  return c;
}

// Every case runs with each codec whose reduce-scatter the device decides.
class ReduceScatterDeferred : public ::testing::TestWithParam<Codec> {};

HostTensor input_of(DType dtype, int rank, int round, int64_t numel, int poisoned_round) {
  std::vector<float> v = testing::normal_floats(numel, 100 * rank + round);
  if (round == poisoned_round && rank == 1) v[numel - 2] = NAN;
  return HostTensor::from_floats(dtype, v);
}

// Outputs, non-finite counts, residuals and steps equal the host path's, with the verdicts read
// by later polls (ready) or by the repeat of the bucket (never ready); nothing waits otherwise.
TEST_P(ReduceScatterDeferred, EqualsTheHostPathOverRoundsWithAPoisonedOne) {
  const int world = 3, rounds = 4, poisoned = 3;  // round 1's bucket 6
  const int64_t shard = 333;
  for (bool ready : {true, false}) {
    std::vector<std::vector<uint8_t>> out[2][world];
    uint64_t nonfinite[2][world] = {};
    int returned_nonfinite[2][world] = {};
    CompressionState state[2][world];
    int waits[world] = {};
    for (int deferred = 0; deferred < 2; ++deferred) {
      InProcessGroup group(world);
      run_ranks(group, [&](int rank, Communicator& host) {
        CorruptingTransport device_comm(host, /*device_memory=*/true);
        DeferredStatusBackend device;
        device.ready = ready;
        auto cpu = make_cpu_backend();
        CompressedReduceScatter rs(deferred ? static_cast<Communicator&>(device_comm) : host,
                                   deferred ? static_cast<Backend&>(device) : *cpu,
                                   v2_config(GetParam()));
        for (int round = 0; round < rounds; ++round) {
          for (uint64_t bucket : {5, 6}) {
            HostTensor x = input_of(DType::kBFloat16, rank, 2 * round + int(bucket - 5),
                                    shard * world, poisoned);
            HostTensor y(DType::kBFloat16, shard);
            if (!rs.reduce_scatter(
                    {x.bytes.data(), y.bytes.data(), shard, DType::kBFloat16, bucket, 3.0f}))
              ++returned_nonfinite[deferred][rank];
            out[deferred][rank].push_back(y.bytes);
          }
        }
        if (deferred) waits[rank] = device.waits;
        rs.flush();
        nonfinite[deferred][rank] = rs.nonfinite_buckets();
        state[deferred][rank] = rs.state();
      });
    }
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_EQ(nonfinite[0][rank], 1u) << "the host path: the poisoned call, on every rank";
      EXPECT_EQ(returned_nonfinite[0][rank], 1) << "the host path returns its own verdict";
      EXPECT_EQ(nonfinite[1][rank], 1u) << "ready " << ready;
      EXPECT_EQ(returned_nonfinite[1][rank], 0) << "the deferred calls return true";
      EXPECT_EQ(waits[rank], ready ? 0 : rounds - 1) << "ready " << ready;
      ASSERT_EQ(out[1][rank].size(), out[0][rank].size());
      for (size_t i = 0; i < out[0][rank].size(); ++i)
        EXPECT_EQ(out[1][rank][i], out[0][rank][i]) << "ready " << ready << " call " << i;
      EXPECT_EQ(state[1][rank].step, state[0][rank].step);
      EXPECT_EQ(state[1][rank].residuals, state[0][rank].residuals) << "ready " << ready;
    }
  }
}

// Rank 0 receives a corrupt payload from rank 1 in round 1. The host path raises in that call;
// the deferred call returns without writing, and the error names bucket and sender at flush() or
// at the bucket's next call (which queues nothing). Both then redo the round: the same steps,
// bytes and residuals.
TEST_P(ReduceScatterDeferred, ACorruptPayloadIsRaisedByNameLaterWithTheHostPathsState) {
  const int world = 2;
  const int64_t shard = 300;
  const DType dtype = DType::kFloat32;
  for (bool by_flush : {true, false}) {
    std::vector<std::vector<uint8_t>> out[2][world];
    std::string message[2];
    CompressionState state[2][world];
    for (int deferred = 0; deferred < 2; ++deferred) {
      InProcessGroup group(world);
      run_ranks(group, [&](int rank, Communicator& host) {
        CorruptingTransport device_comm(host, /*device_memory=*/true);
        CorruptingTransport host_comm(host, /*device_memory=*/false);
        if (rank == 0) device_comm.corrupt_call = host_comm.corrupt_call = 1;
        DeferredStatusBackend device;
        device.ready = false;
        auto cpu = make_cpu_backend();
        CompressedReduceScatter rs(deferred ? static_cast<Communicator&>(device_comm) : host_comm,
                                   deferred ? static_cast<Backend&>(device) : *cpu,
                                   v2_config(GetParam()));
        for (int round = 0; round < 3; ++round) {
          HostTensor x = input_of(dtype, rank, round, shard * world, -1);
          HostTensor y = HostTensor::from_floats(dtype, std::vector<float>(shard, 42.0f));
          const ReduceScatterRequest r{x.bytes.data(), y.bytes.data(), shard, dtype, 5, 2.0f};
          try {
            rs.reduce_scatter(r);
            if (deferred && rank == 0 && round == 1) {
              out[deferred][rank].push_back(y.bytes);  // what the rejected call left
              if (by_flush) {
                rs.flush();
              } else {
                rs.reduce_scatter(r);
              }
              ADD_FAILURE() << "the rejection was not raised";
            }
          } catch (const PayloadError& e) {
            EXPECT_TRUE(rank == 0 && round == 1) << e.what();
            message[deferred] = e.what();
            if (!deferred) out[deferred][rank].push_back(y.bytes);
            continue;
          }
          out[deferred][rank].push_back(y.bytes);
        }
        rs.flush();  // nothing left to raise
        state[deferred][rank] = rs.state();
      });
    }
    // The host path's message names the sender (its bucket is the call that raised); the later
    // error names the bucket too.
    EXPECT_NE(message[0].find("from rank 1"), std::string::npos) << message[0];
    EXPECT_NE(message[1].find("bucket 5 on rank 0"), std::string::npos) << message[1];
    EXPECT_NE(message[1].find("from rank 1"), std::string::npos) << message[1];
    const HostTensor marker = HostTensor::from_floats(dtype, std::vector<float>(shard, 42.0f));
    ASSERT_EQ(out[1][0].size(), 3u);
    EXPECT_EQ(out[1][0][1], marker.bytes) << "output written from a rejected payload";
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_EQ(out[1][rank].size(), out[0][rank].size());
      for (size_t i = 0; i < out[0][rank].size(); ++i)
        EXPECT_EQ(out[1][rank][i], out[0][rank][i])
            << (by_flush ? "flush" : "next call") << " rank " << rank << " call " << i;
      EXPECT_EQ(state[1][rank].step, state[0][rank].step) << "rank " << rank;
      EXPECT_EQ(state[1][rank].residuals, state[0][rank].residuals) << "rank " << rank;
    }
  }
}

// A rejection the host has not read yet holds later buckets too (the device's status is sticky):
// their outputs are not written and their residuals keep, and the error names the first rejected
// bucket with the round counter put back to before it.
TEST_P(ReduceScatterDeferred, CallsAfterAnUnreadRejectionAdvanceNothing) {
  const int world = 2;
  const int64_t shard = 300;
  const DType dtype = DType::kFloat32;
  InProcessGroup group(world);
  run_ranks(group, [&](int rank, Communicator& host) {
    CorruptingTransport comm(host, /*device_memory=*/true);
    if (rank == 0) comm.corrupt_call = 1;
    DeferredStatusBackend device;
    device.ready = false;
    CompressedReduceScatter rs(comm, device, v2_config(GetParam()));
    HostTensor x = input_of(dtype, rank, 0, shard * world, -1);
    HostTensor y(dtype, shard);
    rs.reduce_scatter({x.bytes.data(), y.bytes.data(), shard, dtype, 5, 2.0f});
    const CompressionState before = rs.state();
    rs.reduce_scatter({x.bytes.data(), y.bytes.data(), shard, dtype, 5, 2.0f});  // step 1
    HostTensor marker = HostTensor::from_floats(dtype, std::vector<float>(shard, 42.0f));
    HostTensor z = marker;
    rs.reduce_scatter({x.bytes.data(), z.bytes.data(), shard, dtype, 6, 2.0f});
    if (rank == 1) {
      EXPECT_EQ(rs.next_step(), 2u);
      rs.flush();
      return;
    }
    EXPECT_EQ(z.bytes, marker.bytes) << "a call after the rejection wrote its output";
    std::string message;
    try {
      rs.flush();
    } catch (const PayloadError& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("bucket 5 on rank 0"), std::string::npos) << message;
    EXPECT_NE(message.find("from rank 1"), std::string::npos) << message;
    EXPECT_EQ(rs.next_step(), 1u) << "the round counter was not put back before the rejection";
    const CompressionState after = rs.state();
    EXPECT_EQ(after.residuals.at(5), before.residuals.at(5));
    const std::vector<uint8_t> zeros(after.residuals.at(6).size(), 0);
    EXPECT_EQ(after.residuals.at(6), zeros) << "bucket 6 adopted a residual after the rejection";
    rs.flush();  // raised once
  });
}

// The non-finite counter: the host path counts a bucket at its call, the deferred one when a
// later call reads its verdict, and the run's last call only at flush() (what the front ends'
// stats read). Never ahead of the host path; equal to it after flush().
TEST_P(ReduceScatterDeferred, NonfiniteBucketsAreCountedWhenTheirVerdictArrives) {
  const int world = 2, calls = 6;
  const int64_t shard = 200;
  const DType dtype = DType::kFloat32;
  const auto poisoned = [](int call) { return call == 3 || call == calls - 1; };
  for (bool ready : {true, false}) {
    uint64_t counted[2][world][calls] = {};
    uint64_t flushed[2][world] = {};
    for (int deferred = 0; deferred < 2; ++deferred) {
      InProcessGroup group(world);
      run_ranks(group, [&](int rank, Communicator& host) {
        CorruptingTransport device_comm(host, /*device_memory=*/true);
        DeferredStatusBackend device;
        device.ready = ready;
        auto cpu = make_cpu_backend();
        CompressedReduceScatter rs(deferred ? static_cast<Communicator&>(device_comm) : host,
                                   deferred ? static_cast<Backend&>(device) : *cpu,
                                   v2_config(GetParam()));
        for (int call = 0; call < calls; ++call) {
          std::vector<float> v = testing::normal_floats(shard * world, 10 * rank + call);
          if (rank == 1 && poisoned(call)) v[7] = INFINITY;
          HostTensor x = HostTensor::from_floats(dtype, v);
          HostTensor y(dtype, shard);
          rs.reduce_scatter({x.bytes.data(), y.bytes.data(), shard, dtype,
                             static_cast<uint64_t>(5 + call % 2), 2.0f});
          counted[deferred][rank][call] = rs.nonfinite_buckets();
        }
        rs.flush();
        rs.flush();  // counts nothing twice
        flushed[deferred][rank] = rs.nonfinite_buckets();
      });
    }
    for (int rank = 0; rank < world; ++rank) {
      uint64_t expected = 0;
      for (int call = 0; call < calls; ++call) {
        expected += poisoned(call) ? 1 : 0;
        EXPECT_EQ(counted[0][rank][call], expected) << "the host path, call " << call;
        EXPECT_LE(counted[1][rank][call], expected) << "ready " << ready << " call " << call;
      }
      EXPECT_EQ(counted[1][rank][calls - 1], 1u)
          << "ready " << ready << ": call 3's verdict read by a later call, the last call's not";
      EXPECT_EQ(flushed[0][rank], 2u);
      EXPECT_EQ(flushed[1][rank], 2u)
          << "ready " << ready << ": the last call's verdict at flush()";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, ReduceScatterDeferred, ::testing::Values(Codec::kQ4, Codec::kTopK),
                         [](const ::testing::TestParamInfo<Codec>& info) {
                           return info.param == Codec::kQ4 ? "Q4" : "TopK";
                         });

}  // namespace
}  // namespace gradcomp
