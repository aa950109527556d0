// Q2 through the compressed allreduce and DiLoCo's outer rounds, with in-process ranks, against
// references written from the CPU codec calls and the outer Nesterov step.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/format.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/outer_sync.h"
#include "gradcomp/reduce_scatter.h"
#include "outer_sync_reference.h"
#include "run_ranks.h"

namespace gradcomp {
namespace {

using testing::drift;
using testing::run_ranks;
using testing::sgd_reference;

CompressionConfig q2_config(Q4Algorithm algorithm) {
  CompressionConfig c;
  c.codec = Codec::kQ2;
  c.q4_algorithm = algorithm;
  c.seed = 11;
  return c;
}

// One-phase q2 by hand: every rank encodes its outer gradient with its residual and the key
// (seed, round, bucket 0, rank, phase 0); the mean is the decode of all W payloads / W.
struct OnePhaseReference {
  explicit OnePhaseReference(int world, int64_t n)
      : world(world), n(n), residual(world, std::vector<float>(n, 0.0f)) {}
  std::vector<std::vector<float>> mean_of(const std::vector<std::vector<float>>& g,
                                          uint32_t round) {
    std::vector<std::vector<uint8_t>> payloads(world,
                                               std::vector<uint8_t>(q2_payload_bytes(n, 64)));
    for (int r = 0; r < world; ++r) {
      Segment s{const_cast<float*>(g[r].data()), 0, n};
      Q4EncodeParams e;
      e.codec = format::kCodecQ2;
      e.segments = &s;
      e.num_segments = 1;
      e.numel = n;
      e.residual_in = residual[r].data();
      e.residual_out = residual[r].data();
      e.rng = {11, round, 0, static_cast<uint32_t>(r), 0};
      e.payload = payloads[r].data();
      cpu::q2_encode(e);
    }
    std::vector<const uint8_t*> ptrs;
    for (auto& p : payloads) ptrs.push_back(p.data());
    std::vector<float> mean(n);
    Segment out{mean.data(), 0, n};
    Q4DecodeParams d;
    d.codec = format::kCodecQ2;
    d.payloads = ptrs.data();
    d.num_payloads = world;
    d.payload_bytes = payloads[0].size();
    d.numel = n;
    d.segments = &out;
    d.num_segments = 1;
    d.divisor = static_cast<float>(world);
    cpu::q2_decode(d);
    return std::vector<std::vector<float>>(world, mean);
  }
  int world;
  int64_t n;
  std::vector<std::vector<float>> residual;
};

// W ranks run H inner steps of drift, then OuterSync; the reference runs the same steps and
// averages the outer gradients with `mean_of`, then the Nesterov step.
template <typename MeanOf>
void expect_rounds_equal(int world, CompressionConfig config, MeanOf&& mean_of) {
  const uint32_t h = 3;
  const int64_t n = 700;
  const uint32_t rounds = 4;
  std::vector<std::vector<float>> params(world, std::vector<float>(n));
  for (auto& p : params)
    for (int64_t e = 0; e < n; ++e) p[e] = std::sin(static_cast<float>(e) * 0.37f);
  std::vector<std::vector<float>> mirror = params;
  OuterSyncOptions o;
  o.inner_steps = h;
  InProcessGroup group(world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, config, o, {{params[r].data(), n, DType::kFloat32}});
    for (uint64_t t = 1; t <= rounds * h; ++t) {
      for (int64_t e = 0; e < n; ++e) params[r][e] += drift(r, t, static_cast<size_t>(e));
      sync.step();
    }
    EXPECT_EQ(sync.stats().rounds, rounds);
    EXPECT_EQ(sync.stats().nonfinite_rounds, 0u);
  });
  std::vector<float> anchor = mirror[0], buf(n, 0.0f);
  for (uint32_t round = 0; round < rounds; ++round) {
    std::vector<std::vector<float>> g(world, std::vector<float>(n));
    for (int r = 0; r < world; ++r) {
      for (uint64_t t = round * h + 1; t <= (round + 1) * h; ++t)
        for (int64_t e = 0; e < n; ++e) mirror[r][e] += drift(r, t, static_cast<size_t>(e));
      for (int64_t e = 0; e < n; ++e) g[r][e] = anchor[e] - mirror[r][e];
    }
    const std::vector<std::vector<float>> mean = mean_of(g, round);
    for (int64_t e = 0; e < n; ++e) {
      ASSERT_EQ(mean[0][e], mean[world - 1][e]);
      anchor[e] = sgd_reference(anchor[e], mean[0][e], &buf[e], 0.7f, 0.9f);
    }
    for (auto& m : mirror) m = anchor;
  }
  for (int r = 0; r < world; ++r) EXPECT_EQ(params[r], mirror[r]) << "rank " << r;
}

TEST(Q2OuterSync, OnePhaseRoundsEqualHandWrittenQ2AndNesterovSgd) {
  const int world = 3;
  OnePhaseReference ref(world, 700);
  expect_rounds_equal(world, q2_config(Q4Algorithm::kOnePhase),
                      [&](const std::vector<std::vector<float>>& g, uint32_t round) {
                        return ref.mean_of(g, round);
                      });
}

TEST(Q2OuterSync, TwoPhaseRoundsEqualTheQ2Allreduce) {
  // The default algorithm: the reference averages through CompressedAllreduce (Q2, two-phase).
  const int world = 2;
  const CompressionConfig config = q2_config(Q4Algorithm::kTwoPhase);
  InProcessGroup ref_group(world);
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<std::unique_ptr<CompressedAllreduce>> allreduces;
  for (int r = 0; r < world; ++r) {
    backends.push_back(make_cpu_backend());
    allreduces.push_back(
        std::make_unique<CompressedAllreduce>(ref_group.communicator(r), *backends[r], config));
  }
  expect_rounds_equal(world, config, [&](const std::vector<std::vector<float>>& g, uint32_t round) {
    std::vector<std::vector<float>> out = g;
    run_ranks(ref_group, [&](int r, Communicator&) {
      allreduces[r]->set_step(round);
      const Segment s{out[r].data(), 0, static_cast<int64_t>(out[r].size())};
      ASSERT_TRUE(allreduces[r]->allreduce(&s, 1, DType::kFloat32, 0));
    });
    return out;
  });
}

TEST(Q2OuterSync, RefusedByTheReduceScatterByName) {
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  try {
    CompressedReduceScatter rs(group.communicator(0), *backend, q2_config(Q4Algorithm::kTwoPhase));
    ADD_FAILURE() << "accepted Q2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not take Q2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gradcomp
