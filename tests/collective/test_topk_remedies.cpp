// DGC's top-k remedies in the compressed allreduce: the warm-up schedule, momentum correction
// with factor masking and local clipping against a plain reference, and their checkpoints.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "gradcomp/collectives.h"
#include "gradcomp/engine.h"
#include "gradcomp/inprocess_group.h"
#include "run_ranks.h"
#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;
using testing::run_ranks;

CompressionConfig dgc(float momentum, float clip_norm, uint32_t warmup_steps, bool masking = true) {
  CompressionConfig c;
  c.codec = Codec::kTopK;
  c.topk.ratio = 0.02;
  c.seed = 7;
  c.remedies.momentum = momentum;
  c.remedies.momentum_masking = masking;
  c.remedies.clip_norm = clip_norm;
  c.remedies.warmup_steps = warmup_steps;
  return c;
}

TEST(TopKRemedies, WarmupRaisesSparsityInStagesToTheTarget) {
  CompressionConfig c = dgc(0, 0, 100);
  c.topk.ratio = 0.01;
  // DGC's exponential schedule: density ratio^((s + 1) / (stages + 1)) in stage s of 4.
  EXPECT_DOUBLE_EQ(topk_ratio_at(c, 0), std::pow(0.01, 0.2));
  EXPECT_DOUBLE_EQ(topk_ratio_at(c, 24), std::pow(0.01, 0.2));
  EXPECT_DOUBLE_EQ(topk_ratio_at(c, 25), std::pow(0.01, 0.4));
  EXPECT_DOUBLE_EQ(topk_ratio_at(c, 50), std::pow(0.01, 0.6));
  EXPECT_DOUBLE_EQ(topk_ratio_at(c, 99), std::pow(0.01, 0.8));
  EXPECT_DOUBLE_EQ(topk_ratio_at(c, 100), 0.01);
  EXPECT_DOUBLE_EQ(topk_ratio_at(c, 5000), 0.01);
  c.remedies.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(topk_ratio_at(c, 0), 0.01);
}

TEST(TopKRemedies, WarmupPayloadsShrinkStepByStepOnTheWire) {
  const int world = 2;
  const int64_t n = 5000;
  const CompressionConfig c = dgc(0, 0, 4);
  InProcessGroup group(world);
  std::vector<std::vector<uint64_t>> sent(world);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce a(comm, *backend, c);
    HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, rank));
    Segment seg = x.segment();
    a.allreduce(&seg, 1, DType::kFloat32, 3);  // the first call also checks the layout
    for (uint32_t step = 1; step < 6; ++step) {
      a.advance_step();
      const uint64_t before = comm.bytes_sent();
      a.allreduce(&seg, 1, DType::kFloat32, 3);
      sent[rank].push_back(comm.bytes_sent() - before);
    }
  });
  for (uint32_t step = 1; step < 6; ++step) {
    EXPECT_EQ(sent[0][step - 1], compressed_allreduce_bytes_sent(c, n, world, step)) << step;
    if (step > 1 && step <= 4) EXPECT_LT(sent[0][step - 1], sent[0][step - 2]) << step;
  }
  EXPECT_EQ(sent[0].back(), compressed_allreduce_bytes_sent(c, n, world));
}

// The same algorithm written plainly: per rank a velocity u and an accumulator v;
// g is clipped to clip_norm / sqrt(W) (squares summed in 4096-element chunks), u = m u + g,
// v = v + u, the k largest |v| (ties to the lower index) are sent, and cleared from v and u.
class DgcReference {
 public:
  DgcReference(const CompressionConfig& c, int world, int64_t n)
      : c_(c),
        world_(world),
        u_(world, std::vector<float>(n, 0.0f)),
        v_(world, std::vector<float>(n, 0.0f)) {}

  std::vector<float> step(const std::vector<std::vector<float>>& grads, uint32_t step) {
    const int64_t n = static_cast<int64_t>(grads[0].size());
    const int64_t k = topk_k(n, topk_ratio_at(c_, step));
    std::vector<float> sum(n, 0.0f);
    for (int r = 0; r < world_; ++r) {
      std::vector<float> g = grads[r];
      if (c_.remedies.clip_norm > 0) {
        float total = 0.0f;
        for (int64_t first = 0; first < n; first += 4096) {
          float chunk = 0.0f;
          for (int64_t i = first; i < std::min<int64_t>(n, first + 4096); ++i) chunk += g[i] * g[i];
          total += chunk;
        }
        const float threshold =
            static_cast<float>(c_.remedies.clip_norm / std::sqrt(double(world_)));
        const float norm = std::sqrt(total);
        if (norm > threshold)
          for (float& x : g) x *= threshold / norm;
      }
      std::vector<float>& u = u_[r];
      std::vector<float>& v = v_[r];
      for (int64_t i = 0; i < n; ++i) {
        if (c_.remedies.momentum > 0) {
          u[i] = c_.remedies.momentum * u[i] + g[i];
          v[i] = u[i] + v[i];
        } else {
          v[i] = g[i] + v[i];
        }
      }
      std::vector<int64_t> order(n);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return std::fabs(v[a]) > std::fabs(v[b]); });
      std::vector<int64_t> sent(order.begin(), order.begin() + k);
      std::sort(sent.begin(), sent.end());
      for (int64_t i : sent) {
        sum[i] += v[i];
        v[i] = 0.0f;
        if (c_.remedies.momentum_masking) u[i] = 0.0f;
      }
    }
    for (float& x : sum) x /= static_cast<float>(world_);
    return sum;
  }

 private:
  CompressionConfig c_;
  int world_;
  std::vector<std::vector<float>> u_, v_;
};

// A rank's gradient at a step: a different scale per rank, so ranks do not pick the same k.
std::vector<float> rank_gradient(int64_t n, int rank, uint32_t step) {
  return testing::normal_floats(n, 1000 * step + rank, 0.5f + 0.1f * rank);
}

void expect_matches_reference(const CompressionConfig& c, const char* name) {
  const int world = 3;
  const int64_t n = 9000;  // three clip chunks, the last one short
  const uint32_t steps = 6;
  auto grad = [](int rank, uint32_t step) { return rank_gradient(n, rank, step); };
  InProcessGroup group(world);
  std::vector<std::vector<std::vector<float>>> got(world);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce a(comm, *backend, c);
    for (uint32_t step = 0; step < steps; ++step) {
      HostTensor x = HostTensor::from_floats(DType::kFloat32, grad(rank, step));
      Segment seg = x.segment();
      a.allreduce(&seg, 1, DType::kFloat32, 21);
      a.advance_step();
      got[rank].push_back(x.floats());
    }
  });
  DgcReference reference(c, world, n);
  for (uint32_t step = 0; step < steps; ++step) {
    std::vector<std::vector<float>> grads;
    for (int r = 0; r < world; ++r) grads.push_back(grad(r, step));
    const std::vector<float> expect = reference.step(grads, step);
    for (int r = 0; r < world; ++r)
      ASSERT_EQ(got[r][step], expect) << name << ": rank " << r << " step " << step;
  }
}

TEST(TopKRemedies, MomentumCorrectionWithMaskingEqualsThePlainAlgorithm) {
  expect_matches_reference(dgc(0.9f, 0, 0), "momentum");
}

TEST(TopKRemedies, MomentumCorrectionWithoutMaskingEqualsThePlainAlgorithm) {
  expect_matches_reference(dgc(0.9f, 0, 0, false), "momentum, no masking");
}

TEST(TopKRemedies, ClippingAloneAndWithMomentumAndWarmupEqualThePlainAlgorithm) {
  // A threshold below the gradients' norm (about 0.5 * sqrt(9000) = 47), so clipping acts.
  expect_matches_reference(dgc(0, 20.0f, 0), "clipping");
  expect_matches_reference(dgc(0.8f, 20.0f, 4), "momentum, clipping, warm-up");
}

TEST(TopKRemedies, TheRemediesChangeTheResult) {
  // The reference comparison above would also pass if the options were ignored by both: show
  // they are not, against plain error feedback.
  const CompressionConfig plain = dgc(0, 0, 0), dgc_on = dgc(0.9f, 0, 0);
  DgcReference a(plain, 2, 3000), b(dgc_on, 2, 3000);
  std::vector<std::vector<float>> g = {testing::normal_floats(3000, 1),
                                       testing::normal_floats(3000, 2)};
  a.step(g, 0);
  b.step(g, 0);
  EXPECT_NE(a.step(g, 1), b.step(g, 1));
}

TEST(TopKRemedies, VelocitiesSurviveACheckpointBitForBit) {
  const CompressionConfig c = dgc(0.9f, 10.0f, 3);
  const int world = 2;
  InProcessGroup group(world);
  std::vector<std::vector<float>> uninterrupted(world), resumed(world);
  auto input = [](int rank, uint32_t step) {
    return HostTensor::from_floats(DType::kBFloat16,
                                   testing::normal_floats(2500, 100 * step + rank));
  };
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce a(comm, *backend, c);
    CompressionState saved;
    for (uint32_t step = 0; step < 6; ++step) {
      if (step == 2) saved = a.state();
      HostTensor x = input(rank, step);
      Segment seg = x.segment();
      a.allreduce(&seg, 1, DType::kBFloat16, 5);
      a.advance_step();
      if (step == 5) uninterrupted[rank] = x.floats();
    }
    EXPECT_EQ(saved.velocities.at(5).size(), velocity_bytes(c, 2500));
    // Through the engine's checkpoint record as well.
    EngineState record;
    record.compression = saved;
    CompressedAllreduce b(comm, *backend, c);
    const std::vector<uint8_t> bytes = serialize_engine_state(record);
    b.load_state(parse_engine_state(bytes.data(), bytes.size()).compression);
    for (uint32_t step = 2; step < 6; ++step) {
      HostTensor x = input(rank, step);
      Segment seg = x.segment();
      b.allreduce(&seg, 1, DType::kBFloat16, 5);
      b.advance_step();
      if (step == 5) resumed[rank] = x.floats();
    }
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(uninterrupted[r], resumed[r]) << "rank " << r;
}

TEST(TopKRemedies, ACheckpointWithoutOrWithWrongVelocitiesIsRefused) {
  EngineOptions o;
  o.config = dgc(0.9f, 0, 0);
  o.world_size = 1;
  BucketEngine engine(o);
  EngineState s;
  s.compression.seed = o.config.seed;
  s.world_size = 1;
  s.compression.residuals[9] = std::vector<uint8_t>(400);
  s.layouts[9].params = {{0, 100}};
  try {
    engine.load_state(s);
    FAIL() << "a state without velocities was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no velocity for bucket"), std::string::npos) << e.what();
  }
  s.compression.velocities[9] = std::vector<uint8_t>(396);
  try {
    engine.load_state(s);
    FAIL() << "a velocity of the wrong size was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("velocity of bucket 0x9 has 396 bytes"), std::string::npos)
        << e.what();
  }
  EngineOptions plain = o;
  plain.config.remedies.momentum = 0;
  BucketEngine other(plain);
  s.compression.velocities[9] = std::vector<uint8_t>(400);
  EXPECT_THROW(other.load_state(s), Error);  // velocities this configuration does not keep
}

TEST(TopKRemedies, BadOptionsAreRefusedNamingThem) {
  CompressionConfig c = dgc(1.0f, 0, 0);
  EXPECT_THROW(c.validate(), Error);
  c = dgc(0.9f, 0, 0);
  c.error_feedback = false;
  EXPECT_THROW(c.validate(), Error);
  c = dgc(0, -1.0f, 0);
  EXPECT_THROW(c.validate(), Error);
  c = dgc(0, 0, 10);
  c.remedies.warmup_stages = 0;
  EXPECT_THROW(c.validate(), Error);
  c = dgc(0, 0, 10);
  c.remedies.warmup = static_cast<TopKWarmup>(7);
  EXPECT_THROW(c.validate(), Error);
}

CompressionConfig q4_warmup(uint32_t steps, float momentum = 0) {
  CompressionConfig c = dgc(momentum, 0, steps);
  c.remedies.warmup = TopKWarmup::kQ4;
  return c;
}

TEST(TopKQ4Warmup, SendsTwoPhaseQ4ThenTopKAtTheRatioWithTheResidualCarriedOver) {
  // The same steps through a q4 allreduce, then through a top-k allreduce that starts from q4's
  // whole-bucket residual: what the warm-up must compute, bit for bit, with the bytes of each.
  const int world = 3;
  const int64_t n = 9000;
  const uint32_t warmup = 3, steps = 6;
  const CompressionConfig c = q4_warmup(warmup);
  CompressionConfig q4 = c;
  q4.codec = Codec::kQ4;
  CompressionConfig topk = c;
  topk.remedies = TopKRemedies{};
  EXPECT_DOUBLE_EQ(topk_ratio_at(c, 0), c.topk.ratio);
  EXPECT_TRUE(topk_sends_q4_at(c, warmup - 1));
  EXPECT_FALSE(topk_sends_q4_at(c, warmup));
  for (uint32_t step = 0; step < steps; ++step)
    EXPECT_EQ(compressed_allreduce_bytes_sent(c, n, world, step),
              compressed_allreduce_bytes_sent(step < warmup ? q4 : topk, n, world, step));
  EXPECT_EQ(chunk_residual_bytes(c, n, world), chunk_residual_bytes(q4, n, world));
  auto grad = [](int rank, uint32_t step) { return rank_gradient(n, rank, step); };
  InProcessGroup group(world);
  std::vector<std::vector<std::vector<float>>> got(world), expect(world);
  std::vector<std::vector<uint64_t>> sent(world);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce a(comm, *backend, c);
    for (uint32_t step = 0; step < steps; ++step) {
      HostTensor x = HostTensor::from_floats(DType::kFloat32, grad(rank, step));
      Segment seg = x.segment();
      const uint64_t before = comm.bytes_sent();
      a.allreduce(&seg, 1, DType::kFloat32, 21);
      if (step > 0) sent[rank].push_back(comm.bytes_sent() - before);  // step 0 checks layouts
      const CompressionState s = a.state();
      // The own-chunk residuals live while q4 runs and go with it.
      EXPECT_EQ(s.chunk_residuals.count(21), step < warmup ? 1u : 0u) << step;
      a.advance_step();
      got[rank].push_back(x.floats());
    }
    CompressedAllreduce r4(comm, *backend, q4);
    CompressedAllreduce rk(comm, *backend, topk);
    for (uint32_t step = 0; step < steps; ++step) {
      if (step == warmup) {
        CompressionState s = r4.state();
        s.chunk_residuals.clear();
        rk.load_state(s);
      }
      CompressedAllreduce& r = step < warmup ? r4 : rk;
      HostTensor x = HostTensor::from_floats(DType::kFloat32, grad(rank, step));
      Segment seg = x.segment();
      r.allreduce(&seg, 1, DType::kFloat32, 21);
      r.advance_step();
      expect[rank].push_back(x.floats());
    }
  });
  for (int r = 0; r < world; ++r) {
    for (uint32_t step = 0; step < steps; ++step)
      ASSERT_EQ(got[r][step], expect[r][step]) << "rank " << r << " step " << step;
    for (uint32_t step = 1; step < steps; ++step)
      EXPECT_EQ(sent[r][step - 1], compressed_allreduce_bytes_sent(c, n, world, step)) << step;
  }
  EXPECT_NE(got[0][warmup - 1], got[0][warmup]);
}

TEST(TopKQ4Warmup, MomentumCorrectionRunsThroughTheWarmupOnTheVelocity) {
  // With momentum correction the warm-up sends q4 of u = m u + g (nothing masked); the result
  // equals a q4 allreduce fed the velocity computed plainly.
  const int world = 2;
  const int64_t n = 5000;
  const float m = 0.9f;
  const CompressionConfig c = q4_warmup(4, m);
  CompressionConfig q4 = c;
  q4.codec = Codec::kQ4;
  q4.remedies = TopKRemedies{};
  InProcessGroup group(world);
  std::vector<std::vector<std::vector<float>>> got(world), expect(world);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce a(comm, *backend, c), r(comm, *backend, q4);
    std::vector<float> u(n, 0.0f);
    for (uint32_t step = 0; step < 4; ++step) {
      const std::vector<float> g = testing::normal_floats(n, 10 * step + rank);
      HostTensor x = HostTensor::from_floats(DType::kFloat32, g);
      Segment seg = x.segment();
      a.allreduce(&seg, 1, DType::kFloat32, 4);
      a.advance_step();
      got[rank].push_back(x.floats());
      for (int64_t i = 0; i < n; ++i) u[i] = m * u[i] + g[i];
      HostTensor v = HostTensor::from_floats(DType::kFloat32, u);
      Segment vseg = v.segment();
      r.allreduce(&vseg, 1, DType::kFloat32, 4);
      r.advance_step();
      expect[rank].push_back(v.floats());
    }
  });
  for (int r = 0; r < world; ++r)
    for (uint32_t step = 0; step < 4; ++step)
      ASSERT_EQ(got[r][step], expect[r][step]) << "rank " << r << " step " << step;
}

TEST(TopKQ4Warmup, ACheckpointAtAnyStepOfTheWarmupResumesBitForBit) {
  // Saved before, at and after the switch (at step 3 the saved own-chunk residuals are no longer
  // used), through the engine's checkpoint record, with momentum correction.
  const CompressionConfig c = q4_warmup(3, 0.9f);
  const int world = 2;
  InProcessGroup group(world);
  auto input = [](int rank, uint32_t step) {
    return HostTensor::from_floats(DType::kBFloat16,
                                   testing::normal_floats(2500, 100 * step + rank));
  };
  for (uint32_t save_at : {1u, 3u, 4u}) {
    std::vector<std::vector<float>> uninterrupted(world), resumed(world);
    run_ranks(group, [&](int rank, Communicator& comm) {
      auto backend = make_cpu_backend();
      CompressedAllreduce a(comm, *backend, c);
      CompressionState saved;
      for (uint32_t step = 0; step < 6; ++step) {
        if (step == save_at) saved = a.state();
        HostTensor x = input(rank, step);
        Segment seg = x.segment();
        a.allreduce(&seg, 1, DType::kBFloat16, 5);
        a.advance_step();
        if (step == 5) uninterrupted[rank] = x.floats();
      }
      EngineState record;
      record.compression = saved;
      CompressedAllreduce b(comm, *backend, c);
      const std::vector<uint8_t> bytes = serialize_engine_state(record);
      b.load_state(parse_engine_state(bytes.data(), bytes.size()).compression);
      for (uint32_t step = save_at; step < 6; ++step) {
        HostTensor x = input(rank, step);
        Segment seg = x.segment();
        b.allreduce(&seg, 1, DType::kBFloat16, 5);
        b.advance_step();
        if (step == 5) resumed[rank] = x.floats();
      }
    });
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(uninterrupted[r], resumed[r]) << "rank " << r << ", saved at step " << save_at;
  }
}

TEST(TopKQ4Warmup, RanksThatDisagreeOnTheWarmupAreRefused) {
  InProcessGroup group(2);
  std::vector<std::string> errors(2);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce a(comm, *backend, rank == 0 ? q4_warmup(3) : dgc(0, 0, 3));
    HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(1000, rank));
    Segment seg = x.segment();
    try {
      a.allreduce(&seg, 1, DType::kFloat32, 8);
    } catch (const Error& e) {
      errors[rank] = e.what();
    }
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
}

}  // namespace
}  // namespace gradcomp
