// DiLoCo's outer rounds with in-process ranks: equality with the compressed allreduce of the
// outer gradients and an outer Nesterov step written out here, schedule, fragments, non-finite
// rounds, checkpoints and refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/outer_sync.h"
#include "outer_sync_reference.h"
#include "run_ranks.h"

namespace gradcomp {
namespace {

using testing::drift;
using testing::run_ranks;
using testing::sgd_reference;

CompressionConfig q4_config() {
  CompressionConfig c;
  c.seed = 5;
  return c;
}

struct Ranks {
  explicit Ranks(int world, std::vector<int64_t> sizes) : world(world), sizes(std::move(sizes)) {
    for (int r = 0; r < world; ++r) {
      params.emplace_back();
      for (int64_t n : this->sizes) {
        std::vector<float> p(static_cast<size_t>(n));
        for (size_t e = 0; e < p.size(); ++e) p[e] = std::sin(static_cast<float>(e) * 0.37f);
        params.back().push_back(p);
      }
    }
  }
  std::vector<OuterParam> outer_params(int rank) {
    std::vector<OuterParam> out;
    for (auto& p : params[rank])
      out.push_back({p.data(), static_cast<int64_t>(p.size()), DType::kFloat32});
    return out;
  }
  void inner_step(int rank, uint64_t t) {
    for (auto& p : params[rank])
      for (size_t e = 0; e < p.size(); ++e) p[e] += drift(rank, t, e);
  }
  int world;
  std::vector<int64_t> sizes;
  std::vector<std::vector<std::vector<float>>> params;  // [rank][tensor][element]
};

TEST(OuterSync, RoundsEqualTheAllreduceOfOuterGradientsAndNesterovSgd) {
  const int world = 3;
  const uint32_t h = 4;
  Ranks ranks(world, {300, 150});
  Ranks mirror = ranks;  // the reference's own copy of every rank's parameters
  OuterSyncOptions o;
  o.inner_steps = h;
  InProcessGroup group(world), ref_group(world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), o, ranks.outer_params(r));
    for (uint64_t t = 1; t <= 3 * h; ++t) {
      ranks.inner_step(r, t);
      EXPECT_EQ(sync.step(), t % h == 0 ? 1 : 0);
    }
    EXPECT_EQ(sync.stats().rounds, 3u);
    EXPECT_EQ(sync.stats().uncompressed_bytes, 3u * 2 * 2 * 450 * 4 / 3);
  });
  run_ranks(ref_group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce allreduce(comm, *backend, q4_config());
    std::vector<float> anchor, buf(450, 0.0f);
    for (auto& p : mirror.params[r]) anchor.insert(anchor.end(), p.begin(), p.end());
    for (uint32_t round = 0; round < 3; ++round) {
      for (uint64_t t = round * h + 1; t <= (round + 1) * h; ++t) mirror.inner_step(r, t);
      std::vector<float> g(450);
      size_t at = 0;
      for (auto& p : mirror.params[r])
        for (float v : p) {
          g[at] = anchor[at] - v;
          ++at;
        }
      allreduce.set_step(round);
      const Segment s{g.data(), 0, 450};
      ASSERT_TRUE(allreduce.allreduce(&s, 1, DType::kFloat32, 0));
      for (size_t e = 0; e < 450; ++e)
        anchor[e] = sgd_reference(anchor[e], g[e], &buf[e], 0.7f, 0.9f);
      at = 0;
      for (auto& p : mirror.params[r])
        for (float& v : p) v = anchor[at++];
    }
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(ranks.params[r], mirror.params[r]) << "rank " << r;
    EXPECT_EQ(ranks.params[r], ranks.params[0]) << "rank " << r << " differs from rank 0";
  }
  EXPECT_NE(ranks.params[0][0][0], std::sin(0.0f));
}

TEST(OuterSync, FragmentsSplitTheParametersAndSyncStaggered) {
  const int world = 2;
  Ranks ranks(world, {100, 100, 100, 100});
  OuterSyncOptions o;
  o.inner_steps = 6;
  o.fragments = 2;
  InProcessGroup group(world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), o, ranks.outer_params(r));
    EXPECT_EQ(sync.fragment_params(0), (std::vector<int64_t>{0, 1}));
    EXPECT_EQ(sync.fragment_params(1), (std::vector<int64_t>{2, 3}));
    std::vector<uint64_t> synced_at;
    for (uint64_t t = 1; t <= 12; ++t) {
      ranks.inner_step(r, t);
      if (sync.step() > 0) synced_at.push_back(t);
    }
    EXPECT_EQ(synced_at, (std::vector<uint64_t>{3, 6, 9, 12}));
    EXPECT_EQ(sync.stats().rounds, 4u);
  });
  // Step 12 synced fragment 0; fragment 1 has trained three steps on its own since step 9.
  EXPECT_EQ(ranks.params[0][0], ranks.params[1][0]);
  EXPECT_EQ(ranks.params[0][1], ranks.params[1][1]);
  EXPECT_NE(ranks.params[0][2], ranks.params[1][2]);
}

TEST(OuterSync, EveryFragmentHoldsATensorAndTheOffsetsAreTheirShareOfH) {
  Ranks ranks(1, {10, 300, 20, 20, 200});
  OuterSyncOptions o;
  o.inner_steps = 5;
  o.fragments = 3;
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  OuterSync sync(group.communicator(0), *backend, q4_config(), o, ranks.outer_params(0));
  // 550 elements: fragment 0 reaches a third at tensor 1; fragment 1 stops at tensor 3 so that
  // the last fragment keeps a tensor of its own.
  EXPECT_EQ(sync.fragment_params(0), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(sync.fragment_params(1), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(sync.fragment_params(2), (std::vector<int64_t>{4}));
  // Offsets floor(f * 5 / 3) = 0, 1, 3: fragment 1 after steps 1, 6, 11; fragment 2 after 3, 8.
  std::vector<std::vector<uint64_t>> at(3);
  for (uint64_t t = 1; t <= 11; ++t)
    for (uint32_t f = 0; f < 3; ++f)
      if (sync.due(f, t)) at[f].push_back(t);
  EXPECT_EQ(at[0], (std::vector<uint64_t>{5, 10}));
  EXPECT_EQ(at[1], (std::vector<uint64_t>{1, 6, 11}));
  EXPECT_EQ(at[2], (std::vector<uint64_t>{3, 8}));
}

TEST(OuterSync, RanksOfAnotherHAreNamedInsteadOfAveragingAtDifferentSteps) {
  const int world = 2;
  Ranks ranks(world, {64, 64});
  std::vector<std::string> errors;
  InProcessGroup group(world, 5.0);
  run_ranks(
      group,
      [&](int r, Communicator& comm) {
        auto backend = make_cpu_backend();
        OuterSyncOptions o;
        o.inner_steps = r == 0 ? 2 : 3;  // rank 1 was started with another H
        OuterSync sync(comm, *backend, q4_config(), o, ranks.outer_params(r));
        for (uint32_t t = 0; t < o.inner_steps; ++t) sync.step();
      },
      &errors);
  ASSERT_EQ(errors.size(), 2u);
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("ranks disagree before a sync"), std::string::npos) << e;
    EXPECT_NE(e.find("(H 2, 1 fragments)"), std::string::npos) << e;
  }
}

TEST(OuterSync, NonFiniteMeanResetsToTheAnchorOnEveryRankAndKeepsTheState) {
  const int world = 2;
  Ranks ranks(world, {200});
  const std::vector<float> start = ranks.params[0][0];
  OuterSyncOptions o;
  o.inner_steps = 2;
  InProcessGroup group(world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), o, ranks.outer_params(r));
    const OuterSyncState before = sync.state();
    ranks.inner_step(r, 1);
    sync.step();
    ranks.inner_step(r, 2);
    if (r == 1) ranks.params[1][0][17] = NAN;
    EXPECT_EQ(sync.step(), 1);
    EXPECT_EQ(sync.stats().nonfinite_rounds, 1u);
    EXPECT_EQ(ranks.params[r][0], start) << "rank " << r;
    const OuterSyncState after = sync.state();
    EXPECT_EQ(after.rounds, before.rounds);
    EXPECT_EQ(after.momenta, before.momenta);
    for (const auto& kv : after.compression.residuals)
      for (uint8_t byte : kv.second) ASSERT_EQ(byte, 0) << "a residual changed on rank " << r;
  });
}

TEST(OuterSync, StateResumesBitForBit) {
  const int world = 2;
  Ranks straight(world, {128, 64});
  Ranks resumed = straight;
  OuterSyncOptions o;
  o.inner_steps = 3;
  o.fragments = 2;
  std::vector<OuterSyncState> saved(world);
  InProcessGroup g1(world), g2(world), g3(world);
  run_ranks(g1, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), o, straight.outer_params(r));
    for (uint64_t t = 1; t <= 10; ++t) {
      straight.inner_step(r, t);
      sync.step();
      if (t == 5) saved[r] = sync.state();
      if (t == 5) resumed.params[r] = straight.params[r];
    }
  });
  run_ranks(g2, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), o, resumed.outer_params(r));
    sync.load_state(saved[r]);
    for (uint64_t t = 6; t <= 10; ++t) {
      resumed.inner_step(r, t);
      sync.step();
    }
    EXPECT_EQ(sync.state().inner_step, 10u);
  });
  EXPECT_EQ(resumed.params, straight.params);
  // Another split is refused whole.
  run_ranks(g3, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSyncOptions one = o;
    one.fragments = 1;
    OuterSync sync(comm, *backend, q4_config(), one, resumed.outer_params(r));
    try {
      sync.load_state(saved[r]);
      ADD_FAILURE() << "a two-fragment state loaded into one fragment";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("this run has 1 fragments"), std::string::npos)
          << e.what();
    }
    EXPECT_EQ(sync.state().inner_step, 0u);
  });
}

TEST(OuterSync, LoadRefusesAnotherHResidualsOfOtherSizesAndNonFiniteAnchors) {
  const int world = 2;
  Ranks ranks(world, {128, 64});
  OuterSyncOptions o;
  o.inner_steps = 2;
  std::vector<OuterSyncState> saved(world);
  InProcessGroup group(world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), o, ranks.outer_params(r));
    sync.step();
    sync.step();
    saved[r] = sync.state();
    ASSERT_EQ(saved[r].compression.residuals.size(), 1u);
  });
  auto backend = make_cpu_backend();
  InProcessGroup one(1);
  auto refused = [&](OuterSyncOptions opts, const OuterSyncState& s, const std::string& what) {
    OuterSync sync(one.communicator(0), *backend, q4_config(), opts, ranks.outer_params(0));
    try {
      sync.load_state(s);
      ADD_FAILURE() << "loaded: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    EXPECT_EQ(sync.state().inner_step, 0u) << "a refused state changed something";
  };
  OuterSyncOptions other = o;
  other.inner_steps = 3;
  refused(other, saved[0], "saved with inner_steps (H) 2, this run has 3");
  OuterSyncState s = saved[0];
  s.compression.residuals[7] = s.compression.residuals[0];
  refused(o, s, "residual of fragment 7 but this run has 1 fragments");
  s = saved[0];
  s.compression.residuals[0].resize(8);
  refused(o, s, "holds 8 bytes, this run keeps");
  s = saved[0];
  s.anchors[0][5] = NAN;
  refused(o, s, "non-finite anchor or momentum at element 5");
}

TEST(OuterSync, HierarchicalRoundsAgreeOnEveryRank) {
  testing::NodeGrid grid(2, 2);
  Ranks ranks(4, {257, 31});
  OuterSyncOptions o;
  o.inner_steps = 2;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(4);
  std::vector<uint64_t> bytes(4);
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto backend = make_cpu_backend();
        OuterSync sync(grid.groups(r), *backend, q4_config(), o, ranks.outer_params(r));
        for (uint64_t t = 1; t <= 4; ++t) {
          ranks.inner_step(r, t);
          sync.step();
        }
        bytes[r] = sync.stats().bytes_sent;
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(ranks.params[r], ranks.params[0]) << "rank " << r;
    EXPECT_GT(bytes[r], 0u);
  }
  // The mean moved the parameters the way the ranks' average drift points.
  const float start = std::sin(0.37f);
  EXPECT_NE(ranks.params[0][0][1], start);
}

// A transport over an in-process rank that tallies the bytes it hands to the other ranks, under
// whatever OuterSync or the Communicator above it count.
class WireCounter final : public Communicator {
 public:
  explicit WireCounter(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  bool device_memory() const override { return false; }
  uint64_t moved = 0;

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes) override {
    moved += bytes * static_cast<uint64_t>(world_size() - 1);
    inner_.all_to_all(send, recv, bytes);
  }
  void run_all_gather(const void* send, void* recv, size_t bytes) override {
    moved += bytes * static_cast<uint64_t>(world_size() - 1);
    inner_.all_gather(send, recv, bytes);
  }
  void run_allreduce_mean(void* data, int64_t numel, DType dtype) override {
    moved += ring_allreduce_bytes(numel, dtype, world_size());
    inner_.allreduce_mean(data, numel, dtype);
  }
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                               DType dtype) override {
    moved += reduce_scatter_bytes(numel_per_rank, dtype, world_size());
    inner_.reduce_scatter_mean(send, recv, numel_per_rank, dtype);
  }

 private:
  Communicator& inner_;
};

TEST(OuterSync, BytesSentAreTheBytesTheTransportMoved) {
  const int world = 3;
  Ranks ranks(world, {300, 150});
  OuterSyncOptions o;
  o.inner_steps = 2;
  o.fragments = 2;
  InProcessGroup group(world);
  run_ranks(group, [&](int r, Communicator& comm) {
    WireCounter wire(comm);
    auto backend = make_cpu_backend();
    OuterSync sync(wire, *backend, q4_config(), o, ranks.outer_params(r));
    for (uint64_t t = 1; t <= 6; ++t) {
      ranks.inner_step(r, t);
      sync.step();
    }
    EXPECT_EQ(sync.stats().rounds, 6u);
    EXPECT_GT(wire.moved, 0u);
    EXPECT_EQ(sync.stats().bytes_sent, wire.moved) << "rank " << r;
  });
}

TEST(OuterSync, HierarchicalBytesSentAreTheBytesBothTransportsMoved) {
  testing::NodeGrid grid(2, 2);
  Ranks ranks(4, {257, 31});
  OuterSyncOptions o;
  o.inner_steps = 2;
  testing::run_grid(grid, [&](int r, NodeGroups groups) {
    WireCounter intra(*groups.intra_node), inter(*groups.inter_node);
    auto backend = make_cpu_backend();
    OuterSync sync(NodeGroups{&intra, &inter}, *backend, q4_config(), o, ranks.outer_params(r));
    for (uint64_t t = 1; t <= 4; ++t) {
      ranks.inner_step(r, t);
      sync.step();
    }
    EXPECT_GT(inter.moved, 0u);
    EXPECT_EQ(sync.stats().bytes_sent, intra.moved + inter.moved) << "rank " << r;
  });
}

TEST(OuterSync, ANodeThatDisagreesInsideMakesEveryNodeRaiseTheNamedErrorPromptly) {
  // Node 0's two ranks are one inner step apart (resumed from different checkpoints); node 1's
  // agree among themselves. Every rank must raise the disagreement, not wait out the timeout in
  // the allgather across nodes.
  const double timeout = 20.0;
  testing::NodeGrid grid(2, 2, timeout);
  Ranks ranks(4, {64, 32});
  OuterSyncOptions o;
  o.inner_steps = 100;  // no sync from step(): the test calls sync_fragment itself
  std::vector<std::string> errors(4);
  const auto start = std::chrono::steady_clock::now();
  testing::run_grid(grid, [&](int r, NodeGroups groups) {
    auto backend = make_cpu_backend();
    OuterSync sync(groups, *backend, q4_config(), o, ranks.outer_params(r));
    for (int t = 0; t < (r == 1 ? 2 : 1); ++t) sync.step();
    try {
      sync.sync_fragment(0);
    } catch (const Error& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(errors[static_cast<size_t>(r)].find("disagree"), std::string::npos)
        << "rank " << r << ": " << errors[static_cast<size_t>(r)];
  EXPECT_LT(took, timeout / 4) << "ranks waited for a collective instead of raising";
}

TEST(OuterSync, StatsReadWhileRoundsRunAreNotARace) {
  // A metrics scrape reads stats() on its own thread while the rounds write them (DiLoCo's step
  // runs without the GIL): the ThreadSanitizer stage of scripts/test_all.sh checks this one.
  const int world = 2;
  Ranks ranks(world, {128, 64});
  OuterSyncOptions o;
  o.inner_steps = 1;
  InProcessGroup group(world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), o, ranks.outer_params(r));
    std::atomic<bool> done{false};
    uint64_t seen = 0;
    std::thread scraper([&] {
      while (!done.load()) seen = std::max(seen, sync.stats().rounds);
    });
    for (uint64_t t = 1; t <= 20; ++t) {
      ranks.inner_step(r, t);
      sync.step();
    }
    done = true;
    scraper.join();
    EXPECT_LE(seen, 20u);
    EXPECT_EQ(sync.stats().rounds, 20u);
  });
}

TEST(OuterSync, RefusesBadOptions) {
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  std::vector<float> p(10, 1.0f);
  const std::vector<OuterParam> one{{p.data(), 10, DType::kFloat32}};
  auto refused = [&](OuterSyncOptions o, CompressionConfig c, const std::string& what) {
    try {
      OuterSync sync(group.communicator(0), *backend, c, o, one);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  OuterSyncOptions o;
  o.inner_steps = 0;
  refused(o, q4_config(), "inner_steps");
  o = {};
  o.outer_momentum = 1.0f;
  refused(o, q4_config(), "outer_momentum");
  o = {};
  o.fragments = 2;
  refused(o, q4_config(), "only 1 parameter tensors");
  CompressionConfig topk;
  topk.codec = Codec::kTopK;
  topk.remedies.momentum = 0.9f;
  refused({}, topk, "TopK(momentum=0)");
}

}  // namespace
}  // namespace gradcomp
