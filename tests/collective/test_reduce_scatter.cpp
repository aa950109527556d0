// The compressed reduce-scatter with in-process ranks: equality with a per-row encode and
// decode-and-sum reference, steps, non-finite rows, bad payloads, layouts and checkpoints.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/fault_injection.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/reduce_scatter.h"
#include "run_ranks.h"
#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;
using testing::run_ranks;

CompressionConfig q4_config(DType residual = DType::kFloat32) {
  CompressionConfig c;
  c.seed = 77;
  c.residual_dtype = residual;
  return c;
}

CompressionConfig topk_config(bool exact) {
  CompressionConfig c;
  c.codec = Codec::kTopK;
  c.topk.ratio = 0.1;
  c.topk.exact = exact;
  c.seed = 77;
  return c;
}

// What every rank computes, built from the codec calls one row at a time, keeping every rank's
// residuals itself (fp32 residuals).
class Reference {
 public:
  Reference(const CompressionConfig& c, int world, int64_t shard, uint64_t bucket)
      : c_(c),
        world_(world),
        shard_(shard),
        bucket_(bucket),
        residual_(world, std::vector<float>(static_cast<size_t>(shard * world), 0.0f)) {}

  std::vector<HostTensor> step(const std::vector<HostTensor>& inputs, uint32_t step,
                               float divisor) {
    // payloads[w][r]: rank w's payload of row r.
    std::vector<std::vector<std::vector<uint8_t>>> payloads(world_);
    std::vector<std::vector<float>> next = residual_;
    for (int w = 0; w < world_; ++w) {
      bool nonfinite = false;
      for (int64_t i = 0; i < inputs[w].numel; ++i) nonfinite |= !std::isfinite(inputs[w].get(i));
      for (int r = 0; r < world_; ++r) {
        HostTensor row(inputs[w].dtype, shard_);
        for (int64_t i = 0; i < shard_; ++i) row.set(i, inputs[w].get(r * shard_ + i));
        if (nonfinite) row.set(0, NAN);
        const std::vector<float> res_in(residual_[w].begin() + r * shard_,
                                        residual_[w].begin() + (r + 1) * shard_);
        std::vector<float> res_out;
        if (c_.codec == Codec::kQ4) {
          math::RngKey key{c_.seed, step, static_cast<uint32_t>(bucket_), static_cast<uint32_t>(w),
                           2u + static_cast<uint32_t>(r)};
          auto e = testing::q4_encode_tensor(row, c_.q4.block_size, true, key, res_in,
                                             c_.error_feedback);
          payloads[w].push_back(e.payload);
          res_out = e.residual;
        } else {
          auto e = testing::topk_encode_tensor(row, topk_k(shard_, c_.topk.ratio),
                                               topk_capacity(shard_, c_.topk), c_.topk.exact,
                                               c_.topk.value_dtype, res_in, c_.error_feedback);
          payloads[w].push_back(e.payload);
          res_out = e.residual;
        }
        if (!res_out.empty())
          std::copy(res_out.begin(), res_out.end(), next[w].begin() + r * shard_);
      }
    }
    std::vector<HostTensor> out;
    bool any_nonfinite = false;
    for (int r = 0; r < world_; ++r) {
      HostTensor o(inputs[0].dtype, shard_);
      Segment seg = o.segment();
      std::vector<const uint8_t*> from;
      for (int w = 0; w < world_; ++w) from.push_back(payloads[w][r].data());
      if (c_.codec == Codec::kQ4) {
        o = testing::q4_decode_payloads({&payloads[0][r]}, shard_, c_.q4.block_size, o.dtype);
        std::vector<const std::vector<uint8_t>*> all;
        for (int w = 0; w < world_; ++w) all.push_back(&payloads[w][r]);
        o = testing::q4_decode_payloads(all, shard_, c_.q4.block_size, o.dtype, divisor);
      } else {
        std::vector<uint8_t> workspace(cpu::topk_workspace_bytes(shard_));
        TopKDecodeParams d;
        d.payloads = from.data();
        d.num_payloads = world_;
        d.payload_bytes = payloads[0][r].size();
        d.numel = shard_;
        d.capacity = static_cast<uint32_t>(topk_capacity(shard_, c_.topk));
        d.value_dtype = static_cast<uint8_t>(c_.topk.value_dtype);
        d.segments = &seg;
        d.num_segments = 1;
        d.dtype = static_cast<uint8_t>(o.dtype);
        d.divisor = divisor;
        d.workspace = workspace.data();
        cpu::topk_decode(d);
      }
      for (int64_t i = 0; i < shard_; ++i) any_nonfinite |= !std::isfinite(o.get(i));
      out.push_back(std::move(o));
    }
    if (!any_nonfinite) residual_ = next;
    return out;
  }

 private:
  CompressionConfig c_;
  int world_;
  int64_t shard_;
  uint64_t bucket_;
  std::vector<std::vector<float>> residual_;
};

std::vector<HostTensor> inputs_at(int world, int64_t shard, DType dtype, uint32_t step) {
  std::vector<HostTensor> in;
  for (int w = 0; w < world; ++w) {
    const auto v = testing::normal_floats(shard * world, 1000 * step + w + 1);
    in.push_back(HostTensor::from_floats(dtype, v));
  }
  return in;
}

void expect_same_bytes(const HostTensor& a, const HostTensor& b, const std::string& what) {
  ASSERT_EQ(a.bytes.size(), b.bytes.size()) << what;
  EXPECT_TRUE(a.bytes == b.bytes) << what;
}

// Runs `steps` steps of one bucket on every rank; outputs[step][rank].
std::vector<std::vector<HostTensor>> run_engine(const CompressionConfig& c, int world,
                                                int64_t shard, DType dtype, int steps,
                                                float divisor, std::vector<char>* finite = nullptr,
                                                int nan_rank = -1, int nan_step = -1) {
  InProcessGroup group(world);
  std::vector<std::vector<HostTensor>> out(steps, std::vector<HostTensor>(world));
  // Not vector<bool>: its bits share words, and the ranks write their own elements at once.
  if (finite) finite->assign(static_cast<size_t>(steps * world), 1);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedReduceScatter rs(comm, *backend, c);
    for (int s = 0; s < steps; ++s) {
      HostTensor x = inputs_at(world, shard, dtype, s)[rank];
      if (rank == nan_rank && s == nan_step) x.set(shard * world - 1, NAN);
      HostTensor y(dtype, shard);
      ReduceScatterRequest r{x.data(), y.data(), shard, dtype, 5, divisor};
      const bool ok = rs.reduce_scatter(r);
      if (finite) (*finite)[s * world + rank] = ok;
      out[s][rank] = std::move(y);
    }
  });
  return out;
}

TEST(ReduceScatter, EqualsThePerRowReferenceByteForByte) {
  struct Case {
    const char* name;
    CompressionConfig config;
    DType dtype;
  };
  const std::vector<Case> cases = {{"q4_fp32", q4_config(), DType::kFloat32},
                                   {"q4_bf16", q4_config(), DType::kBFloat16},
                                   {"topk_exact", topk_config(true), DType::kFloat32},
                                   {"topk_approx", topk_config(false), DType::kBFloat16}};
  for (const Case& k : cases) {
    for (int world : {2, 3}) {
      // Shards that are not a whole number of q4 blocks: every row's blocks start at its head.
      for (int64_t shard : {int64_t{1}, int64_t{100}, int64_t{1000}}) {
        for (float divisor : {static_cast<float>(world), 1.0f, 1.0f / 0.3f}) {
          const int steps = 3;
          auto got = run_engine(k.config, world, shard, k.dtype, steps, divisor);
          Reference ref(k.config, world, shard, 5);
          for (int s = 0; s < steps; ++s) {
            auto want = ref.step(inputs_at(world, shard, k.dtype, s), s, divisor);
            for (int r = 0; r < world; ++r) {
              expect_same_bytes(got[s][r], want[r],
                                std::string(k.name) + " W=" + std::to_string(world) +
                                    " shard=" + std::to_string(shard) + " step " +
                                    std::to_string(s) + " rank " + std::to_string(r));
            }
          }
        }
      }
    }
  }
}

TEST(ReduceScatter, ResidualsCarryTheRoundingErrorSoTheMeanOfManyStepsIsClose) {
  // The same input every step: with error feedback the sent rows' mean converges to the input's.
  const int world = 2;
  const int64_t shard = 512;
  InProcessGroup group(world);
  std::vector<double> err_first(world), err_mean(world);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedReduceScatter rs(comm, *backend, q4_config());
    HostTensor x = inputs_at(world, shard, DType::kFloat32, 0)[0];  // same on both ranks
    std::vector<double> sum(shard, 0.0);
    const int steps = 64;
    for (int s = 0; s < steps; ++s) {
      HostTensor y(DType::kFloat32, shard);
      ASSERT_TRUE(rs.reduce_scatter({x.data(), y.data(), shard, DType::kFloat32, 1, 2.0f}));
      for (int64_t i = 0; i < shard; ++i) {
        sum[i] += y.get(i);
        if (s == 0) err_first[rank] += std::fabs(y.get(i) - x.get(rank * shard + i));
      }
    }
    for (int64_t i = 0; i < shard; ++i)
      err_mean[rank] += std::fabs(sum[i] / steps - x.get(rank * shard + i));
    EXPECT_EQ(rs.next_step(), static_cast<uint32_t>(steps));
  });
  for (int r = 0; r < world; ++r) EXPECT_LT(err_mean[r] * 8, err_first[r]) << "rank " << r;
}

TEST(ReduceScatter, ANonFiniteInputOnOneRankReachesEveryRanksOutputAndKeepsEveryResidual) {
  for (const CompressionConfig& c : {q4_config(), topk_config(true)}) {
    const int world = 3;
    const int64_t shard = 200;
    std::vector<char> finite;
    // Rank 1's NaN sits in the last row (rank 2's); every rank must see a non-finite output.
    auto got = run_engine(c, world, shard, DType::kFloat32, 3, 3.0f, &finite, 1, 1);
    Reference ref(c, world, shard, 5);
    for (int s = 0; s < 3; ++s) {
      auto in = inputs_at(world, shard, DType::kFloat32, s);
      if (s == 1) in[1].set(shard * world - 1, NAN);
      auto want = ref.step(in, s, 3.0f);
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(finite[s * world + r] != 0, s != 1) << "step " << s << " rank " << r;
        bool any_nan = false;
        for (int64_t i = 0; i < shard; ++i) any_nan |= std::isnan(got[s][r].get(i));
        EXPECT_EQ(any_nan, s == 1) << "step " << s << " rank " << r;
        // Step 2 equals the reference, which kept every residual at step 1.
        if (s != 1) expect_same_bytes(got[s][r], want[r], "step " + std::to_string(s));
      }
    }
  }
}

TEST(ReduceScatter, ABadPayloadIsRefusedNamingTheRankAndLeavesOutputAndResidualAlone) {
  const int world = 2;
  const int64_t shard = 300;
  InProcessGroup group(world);
  std::vector<std::string> errors;
  run_ranks(
      group,
      [&](int rank, Communicator& inner) {
        FaultSpec spec;
        spec.action = FaultSpec::Action::kFlipBits;
        spec.collective = "all_to_all";
        spec.call = 1;  // step 1 (the layout check is an allgather)
        spec.rank = 1;
        FaultInjectingCommunicator comm(inner, spec);
        auto backend = make_cpu_backend();
        CompressedReduceScatter rs(comm, *backend, q4_config());
        HostTensor x = inputs_at(world, shard, DType::kFloat32, 0)[rank];
        HostTensor y(DType::kFloat32, shard);
        ASSERT_TRUE(rs.reduce_scatter({x.data(), y.data(), shard, DType::kFloat32, 9, 2.0f}));
        const CompressionState before = rs.state();
        HostTensor marker =
            HostTensor::from_floats(DType::kFloat32, std::vector<float>(shard, 42.0f));
        try {
          rs.reduce_scatter({x.data(), marker.data(), shard, DType::kFloat32, 9, 2.0f});
        } catch (...) {
          EXPECT_EQ(marker.floats(), std::vector<float>(shard, 42.0f));
          EXPECT_EQ(rs.state().residuals, before.residuals);
          throw;
        }
      },
      &errors);
  ASSERT_EQ(errors.size(), 2u);
  for (const std::string& e : errors) EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
}

TEST(ReduceScatter, LayoutMismatchIsRefusedOnEveryRankNamingBoth) {
  const int world = 2;
  InProcessGroup group(world);
  std::vector<std::string> errors;
  run_ranks(
      group,
      [&](int rank, Communicator& comm) {
        auto backend = make_cpu_backend();
        CompressedReduceScatter rs(comm, *backend, q4_config());
        const int64_t shard = rank == 0 ? 100 : 101;
        HostTensor x(DType::kFloat32, shard * world), y(DType::kFloat32, shard);
        rs.reduce_scatter({x.data(), y.data(), shard, DType::kFloat32, 3, 2.0f});
      },
      &errors);
  ASSERT_EQ(errors.size(), 2u);
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("layout mismatch"), std::string::npos) << e;
    EXPECT_NE(e.find("reduce-scatter bucket 3 with 200"), std::string::npos) << e;
    EXPECT_NE(e.find("reduce-scatter bucket 3 with 202"), std::string::npos) << e;
  }
}

TEST(ReduceScatter, CheckpointResumeIsBitIdenticalAndAnotherWorldSizeIsRefused) {
  const int world = 2;
  const int64_t shard = 333;
  const CompressionConfig c = q4_config(DType::kBFloat16);
  auto whole = run_engine(c, world, shard, DType::kFloat32, 4, 2.0f);
  InProcessGroup group(world);
  std::vector<CompressionState> saved(world);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedReduceScatter rs(comm, *backend, c);
    for (int s = 0; s < 2; ++s) {
      HostTensor x = inputs_at(world, shard, DType::kFloat32, s)[rank];
      HostTensor y(DType::kFloat32, shard);
      rs.reduce_scatter({x.data(), y.data(), shard, DType::kFloat32, 5, 2.0f});
    }
    saved[rank] = rs.state();
    EXPECT_EQ(saved[rank].step, 2u);
  });
  InProcessGroup again(world);
  run_ranks(again, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedReduceScatter rs(comm, *backend, c);
    rs.load_state(saved[rank]);
    for (int s = 2; s < 4; ++s) {
      HostTensor x = inputs_at(world, shard, DType::kFloat32, s)[rank];
      HostTensor y(DType::kFloat32, shard);
      rs.reduce_scatter({x.data(), y.data(), shard, DType::kFloat32, 5, 2.0f});
      EXPECT_TRUE(y.bytes == whole[s][rank].bytes) << "step " << s << " rank " << rank;
    }
  });
  // Three ranks cannot take two ranks' residuals: the error says why, before anything is sent.
  InProcessGroup three(3);
  std::vector<std::string> errors;
  run_ranks(
      three,
      [&](int rank, Communicator& comm) {
        auto backend = make_cpu_backend();
        CompressedReduceScatter rs(comm, *backend, c);
        rs.load_state(saved[rank % 2]);
        HostTensor x(DType::kFloat32, shard * 3), y(DType::kFloat32, shard);
        rs.reduce_scatter({x.data(), y.data(), shard, DType::kFloat32, 5, 3.0f});
      },
      &errors);
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_NE(errors[0].find("another world size"), std::string::npos) << errors[0];
}

TEST(ReduceScatter, BytesAreAboutAnEighthOfAnFp32ReduceScatter) {
  const CompressionConfig c = q4_config();
  for (int world : {2, 4, 8}) {
    const int64_t shard = 1 << 20;
    const double ratio = static_cast<double>(reduce_scatter_bytes(shard, DType::kFloat32, world)) /
                         compressed_reduce_scatter_bytes_sent(c, shard, world);
    EXPECT_GT(ratio, 7.0) << world;
    EXPECT_LT(ratio, 8.0) << world;
  }
  InProcessGroup group(2);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedReduceScatter rs(comm, *backend, c);
    HostTensor x(DType::kFloat32, 2000), y(DType::kFloat32, 1000);
    rs.reduce_scatter({x.data(), y.data(), 1000, DType::kFloat32, 1, 2.0f});
    const uint64_t after_first = comm.bytes_sent();
    rs.reduce_scatter({x.data(), y.data(), 1000, DType::kFloat32, 1, 2.0f});
    EXPECT_EQ(comm.bytes_sent() - after_first, compressed_reduce_scatter_bytes_sent(c, 1000, 2));
  });
}

TEST(ReduceScatter, TopKRemediesAreRefused) {
  CompressionConfig c = topk_config(true);
  c.remedies.momentum = 0.9f;
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  EXPECT_THROW(CompressedReduceScatter(group.communicator(0), *backend, c), Error);
}

}  // namespace
}  // namespace gradcomp
