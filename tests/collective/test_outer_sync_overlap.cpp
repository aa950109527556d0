// Streaming DiLoCo's overlap with in-process ranks: rounds merged tau steps late with mixing alpha,
// equal to a sequential reference of the same rule; resume mid-overlap, failures, stats, refusals.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/fault_injection.h"
#include "gradcomp/forwarding_backend.h"
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

float mix_reference(float local, float global, float alpha) {
  volatile float a = alpha * local;
  volatile float b = (1.0f - alpha) * global;
  return a + b;
}

// Every rank holds the same tensors at the start; rank r's inner steps drift them its own way.
using Params = std::vector<std::vector<std::vector<float>>>;  // [rank][tensor][element]

Params make_params(int world, const std::vector<int64_t>& sizes) {
  Params out(static_cast<size_t>(world));
  for (auto& rank : out)
    for (int64_t n : sizes) {
      std::vector<float> p(static_cast<size_t>(n));
      for (size_t e = 0; e < p.size(); ++e) p[e] = std::sin(static_cast<float>(e) * 0.37f);
      rank.push_back(p);
    }
  return out;
}

std::vector<OuterParam> outer_params(std::vector<std::vector<float>>& tensors) {
  std::vector<OuterParam> out;
  for (auto& p : tensors)
    out.push_back({p.data(), static_cast<int64_t>(p.size()), DType::kFloat32});
  return out;
}

void inner_step(std::vector<std::vector<float>>& tensors, int rank, uint64_t t) {
  for (auto& p : tensors)
    for (size_t e = 0; e < p.size(); ++e) p[e] += drift(rank, t, e);
}

struct Case {
  int world;
  uint32_t fragments, h, tau;
  float alpha;
  bool eager = false;
};

std::string name(const Case& c) {
  return "W" + std::to_string(c.world) + "_F" + std::to_string(c.fragments) + "_H" +
         std::to_string(c.h) + "_Tau" + std::to_string(c.tau) + "_Alpha" +
         std::to_string(static_cast<int>(c.alpha * 10)) + "Tenths" + (c.eager ? "_Eager" : "");
}

// ctest's names of the cases (gtest_discover_tests takes the printed parameter).
void PrintTo(const Case& c, std::ostream* os) {
  *os << name(c);
}

// The rule written out sequentially: at fragment f's sync point g = anchor - param goes through
// the compressed allreduce at once; tau steps later the anchor takes the outer step with that
// mean and the parameters become alpha * (their value then) + (1 - alpha) * anchor. Eager: the
// sync point also moves the parameters to this rank's own outer step (on a copy of the buffer),
// and the merge adds anchor - that eager anchor to them instead of mixing.
void reference_run(const Case& c, Params& params, uint64_t steps) {
  InProcessGroup group(c.world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce allreduce(comm, *backend, q4_config());
    auto& mine = params[static_cast<size_t>(r)];
    const size_t tensors = mine.size(), per = tensors / c.fragments;
    struct Frag {
      std::vector<float> anchor, buf, mean, eager;
      uint32_t round = 0;
      uint64_t merge = 0;
    };
    std::vector<Frag> frags(c.fragments);
    auto gather = [&](uint32_t f) {
      std::vector<float> v;
      for (size_t i = f * per; i < (f + 1) * per; ++i)
        v.insert(v.end(), mine[i].begin(), mine[i].end());
      return v;
    };
    auto scatter = [&](uint32_t f, const std::vector<float>& v) {
      size_t at = 0;
      for (size_t i = f * per; i < (f + 1) * per; ++i)
        for (float& x : mine[i]) x = v[at++];
    };
    for (uint32_t f = 0; f < c.fragments; ++f) {
      frags[f].anchor = gather(f);
      frags[f].buf.assign(frags[f].anchor.size(), 0.0f);
    }
    auto merge = [&](uint32_t f) {
      Frag& fr = frags[f];
      std::vector<float> local = gather(f);
      for (size_t e = 0; e < local.size(); ++e) {
        fr.anchor[e] = sgd_reference(fr.anchor[e], fr.mean[e], &fr.buf[e], 0.7f, 0.9f);
        if (c.eager)
          local[e] = local[e] + (fr.anchor[e] - fr.eager[e]);
        else
          local[e] =
              c.alpha == 0.0f ? fr.anchor[e] : mix_reference(local[e], fr.anchor[e], c.alpha);
      }
      ++fr.round;
      fr.merge = 0;
      scatter(f, local);
    };
    for (uint64_t t = 1; t <= steps; ++t) {
      inner_step(mine, r, t);
      for (uint32_t f = 0; f < c.fragments; ++f)
        if (frags[f].merge == t) merge(f);
      for (uint32_t f = 0; f < c.fragments; ++f) {
        if (t % c.h != uint64_t{f} * c.h / c.fragments) continue;
        Frag& fr = frags[f];
        std::vector<float> g = gather(f);
        for (size_t e = 0; e < g.size(); ++e) g[e] = fr.anchor[e] - g[e];
        if (c.eager) {
          fr.eager.resize(g.size());
          for (size_t e = 0; e < g.size(); ++e) {
            float scratch = fr.buf[e];
            fr.eager[e] = sgd_reference(fr.anchor[e], g[e], &scratch, 0.7f, 0.9f);
          }
          scatter(f, fr.eager);
        }
        allreduce.set_step(fr.round);
        const Segment s{g.data(), 0, static_cast<int64_t>(g.size())};
        ASSERT_TRUE(allreduce.allreduce(&s, 1, DType::kFloat32, f));
        fr.mean = g;
        fr.merge = t + c.tau;
      }
    }
    // flush(): the round still in flight merges now.
    for (uint32_t f = 0; f < c.fragments; ++f)
      if (frags[f].merge != 0) merge(f);
  });
}

OuterSyncOptions options(const Case& c) {
  OuterSyncOptions o;
  o.inner_steps = c.h;
  o.fragments = c.fragments;
  o.overlap_steps = c.tau;
  o.mixing = c.alpha;
  o.eager = c.eager;
  return o;
}

class OuterSyncOverlap : public ::testing::TestWithParam<Case> {};

TEST_P(OuterSyncOverlap, EqualsTheSequentialReferenceOfTheDelayedMixedRule) {
  const Case c = GetParam();
  const uint64_t steps = 4 * c.h + c.tau;  // about four rounds of every fragment
  uint64_t rounds = 0;
  for (uint64_t t = 1; t <= steps; ++t)
    for (uint64_t f = 0; f < c.fragments; ++f) rounds += t % c.h == f * c.h / c.fragments;
  Params ranks = make_params(c.world, {96, 64, 80, 48});
  Params mirror = ranks;
  InProcessGroup group(c.world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), options(c), outer_params(ranks[r]));
    for (uint64_t t = 1; t <= steps; ++t) {
      inner_step(ranks[r], r, t);
      sync.step();
    }
    sync.flush();
    EXPECT_FALSE(sync.flush());
    EXPECT_EQ(sync.stats().rounds, rounds);
  });
  reference_run(c, mirror, steps);
  for (int r = 0; r < c.world; ++r) EXPECT_EQ(ranks[r], mirror[r]) << "rank " << r;
  EXPECT_NE(ranks[0][0][3], std::sin(3 * 0.37f));
  if (c.alpha == 0.0f && c.fragments == 1 && !c.eager) EXPECT_EQ(ranks[1], ranks[0]);
}

// Named OuterSync/... so that the OuterSync* filter (the TSan run's) takes them too.
INSTANTIATE_TEST_SUITE_P(
    OuterSync, OuterSyncOverlap,
    ::testing::Values(Case{2, 1, 6, 2, 0.0f}, Case{2, 1, 6, 2, 0.5f}, Case{3, 1, 6, 5, 0.5f},
                      Case{2, 2, 6, 2, 0.0f}, Case{3, 2, 6, 2, 0.5f}, Case{3, 2, 8, 3, 0.0f},
                      // Offsets 0, 1, 3, 4: fragment 0 merges at fragment 1's sync point.
                      Case{2, 4, 6, 1, 0.5f},
                      // Eager: its own outer step at the sync point, corrected at the merge.
                      Case{2, 1, 6, 2, 0.0f, true}, Case{3, 1, 6, 5, 0.0f, true},
                      Case{2, 2, 6, 2, 0.0f, true}, Case{3, 2, 8, 3, 0.0f, true},
                      Case{3, 4, 6, 1, 0.0f, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return name(info.param); });

// The CPU backend, counting its allocations.
class CountingBackend final : public ForwardingBackend {
 public:
  CountingBackend() : ForwardingBackend(make_cpu_backend()) {}
  void* allocate(size_t bytes) override {
    ++allocations;
    return ForwardingBackend::allocate(bytes);
  }
  std::atomic<int> allocations{0};
};

// A round's buffers (its copies of the outer state, the agreement's) are kept for the next round:
// past the first rounds, fragments of two sizes sync and merge without a backend allocation (each
// would page-fault and zero a parameter-sized buffer on the caller's thread; cudaMalloc waits for
// the device).
TEST(OuterSync, OverlapRoundsAllocateNothingOnceEveryFragmentHasSynced) {
  for (const bool eager : {false, true}) {
    const Case c{2, 2, 6, 2, 0.0f, eager};
    Params ranks = make_params(c.world, {96, 64, 80, 48});  // fragments of 160 and 128
    Params mirror = ranks;
    InProcessGroup group(c.world);
    run_ranks(group, [&](int r, Communicator& comm) {
      CountingBackend backend;
      OuterSync sync(comm, backend, q4_config(), options(c), outer_params(ranks[r]));
      int after_warmup = 0;
      for (uint64_t t = 1; t <= 5 * c.h; ++t) {
        inner_step(ranks[r], r, t);
        sync.step();
        if (t == 2 * c.h) after_warmup = backend.allocations.load();
      }
      sync.flush();
      EXPECT_EQ(sync.stats().rounds, 10u);
      EXPECT_EQ(backend.allocations.load(), after_warmup) << name(c) << ", rank " << r;
    });
    reference_run(c, mirror, 5 * c.h);
    EXPECT_EQ(ranks, mirror) << name(c);
  }
}

// Saves every rank's state after step 7 (fragment 0 synced after step 6, merges after step 8),
// resumes from it, and expects the unbroken run's parameters; returns the saved states.
std::vector<OuterSyncState> resume_mid_overlap(const Case& c) {
  Params straight = make_params(c.world, {96, 64, 80, 48});
  Params resumed = straight;
  std::vector<OuterSyncState> saved(c.world);
  InProcessGroup g1(c.world), g2(c.world);
  run_ranks(g1, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), options(c), outer_params(straight[r]));
    for (uint64_t t = 1; t <= 20; ++t) {
      inner_step(straight[r], r, t);
      sync.step();
      if (t == 7) {
        saved[r] = sync.state();
        resumed[r] = straight[r];
      }
    }
  });
  EXPECT_EQ(saved[0].pending.size(), 1u);
  if (saved[0].pending.size() != 1u || saved[1].pending.size() != 1u) return saved;
  EXPECT_EQ(saved[0].pending[0].fragment, 0u);
  EXPECT_EQ(saved[0].pending[0].merge_step, 8u);
  run_ranks(g2, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), options(c), outer_params(resumed[r]));
    sync.load_state(saved[r]);
    for (uint64_t t = 8; t <= 20; ++t) {
      inner_step(resumed[r], r, t);
      sync.step();
    }
  });
  EXPECT_EQ(resumed, straight);
  return saved;
}

TEST(OuterSync, OverlapResumesBitForBitWithARoundInFlight) {
  const Case c{2, 2, 6, 2, 0.5f};
  const std::vector<OuterSyncState> saved = resume_mid_overlap(c);
  ASSERT_EQ(saved[0].pending.size(), 1u);
  EXPECT_TRUE(saved[0].pending[0].eager.empty());
  // A state with a round in flight is refused by a run without overlap.
  InProcessGroup g3(1);
  Params one = make_params(1, {96, 64, 80, 48});
  auto backend = make_cpu_backend();
  OuterSyncOptions blocking = options(c);
  blocking.overlap_steps = 0;
  OuterSync sync(g3.communicator(0), *backend, q4_config(), blocking, outer_params(one[0]));
  try {
    sync.load_state(saved[0]);
    ADD_FAILURE() << "a round in flight loaded into overlap_steps = 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("overlap_steps = 0"), std::string::npos) << e.what();
  }
}

TEST(OuterSync, EagerResumesBitForBitWithARoundInFlightAndItsEagerAnchor) {
  const Case c{2, 2, 6, 2, 0.0f, true};
  const std::vector<OuterSyncState> saved = resume_mid_overlap(c);
  ASSERT_EQ(saved[0].pending.size(), 1u);
  // Each rank's own outer step: fragment 0 is tensors 0 and 1.
  ASSERT_EQ(saved[0].pending[0].eager.size(), 96u + 64u);
  EXPECT_NE(saved[0].pending[0].eager, saved[1].pending[0].eager);
  // An eager state is refused by a run without eager, and the other way round, changing nothing.
  InProcessGroup solo(1);
  Params one = make_params(1, {96, 64, 80, 48});
  auto backend = make_cpu_backend();
  for (bool eager : {false, true}) {
    OuterSyncOptions o = options(c);
    o.eager = eager;
    OuterSync sync(solo.communicator(0), *backend, q4_config(), o, outer_params(one[0]));
    OuterSyncState state = saved[0];
    if (eager) state.pending[0].eager.clear();
    try {
      sync.load_state(state);
      ADD_FAILURE() << "a round in flight loaded with the other eager setting";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("eager anchor values, this run (eager = " +
                                           std::string(eager ? "true" : "false")),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(sync.state().inner_step, 0u);
  }
}

TEST(OuterSync, OverlapNonFiniteMeanAtTheMergeResetsToTheAnchorOnEveryRank) {
  const Case c{2, 1, 4, 2, 0.5f};
  Params ranks = make_params(c.world, {200});
  const std::vector<float> start = ranks[0][0];
  InProcessGroup group(c.world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), options(c), outer_params(ranks[r]));
    for (uint64_t t = 1; t <= 6; ++t) {
      inner_step(ranks[r], r, t);
      if (t == 4 && r == 1) ranks[1][0][17] = NAN;
      sync.step();
      if (t == 4 || t == 5) EXPECT_NE(ranks[r][0], start);  // not merged yet
    }
    EXPECT_EQ(ranks[r][0], start) << "rank " << r;
    EXPECT_EQ(sync.stats().nonfinite_rounds, 1u);
    EXPECT_EQ(sync.state().rounds, std::vector<uint32_t>{0});
  });
}

TEST(OuterSync, OverlapARoundThatFailsRaisesAtTheMergeOnEveryRankNamingIt) {
  const int world = 3;
  const Case c{world, 1, 4, 2, 0.0f};
  Params ranks = make_params(world, {300});
  InProcessGroup group(world, 1.0);
  std::vector<std::string> errors(world), after(world);
  const auto start = std::chrono::steady_clock::now();
  run_ranks(group, [&](int r, Communicator& inner) {
    FaultSpec spec;
    spec.action = FaultSpec::Action::kFail;
    spec.collective = "all_to_all";
    spec.call = 1;  // the second round's
    spec.rank = 1;
    FaultInjectingCommunicator comm(inner, spec);
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), options(c), outer_params(ranks[r]));
    for (uint64_t t = 1; t <= 12; ++t) {
      inner_step(ranks[r], r, t);
      try {
        sync.step();
      } catch (const Error& e) {
        EXPECT_EQ(t, 10u) << "rank " << r;  // the second round synced after 8, merges after 10
        errors[r] = e.what();
        break;
      }
    }
    try {
      sync.step();
    } catch (const Error& e) {
      after[r] = e.what();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8));
  EXPECT_NE(errors[1].find("injected transport failure"), std::string::npos) << errors[1];
  for (int r = 0; r < world; ++r) {
    EXPECT_NE(errors[r].find("background round of fragment 0 (round 1, synced after inner step 8)"),
              std::string::npos)
        << errors[r];
    // A spent DiLoCo keeps refusing, with the same words.
    EXPECT_NE(after[r].find("background round of fragment 0 (round 1"), std::string::npos)
        << after[r];
  }
}

TEST(OuterSync, OverlapStatsSeparateBlockedFromBackgroundSecondsAndCountTheSameBytes) {
  const Case c{2, 2, 6, 2, 0.0f};
  Params overlapped = make_params(c.world, {96, 64, 80, 48});
  Params blocking = overlapped;
  std::vector<OuterSyncStats> with(c.world), without(c.world);
  InProcessGroup g1(c.world), g2(c.world);
  run_ranks(g1, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSync sync(comm, *backend, q4_config(), options(c), outer_params(overlapped[r]));
    for (uint64_t t = 1; t <= 14; ++t) {
      inner_step(overlapped[r], r, t);
      sync.step();
    }
    with[r] = sync.stats();
  });
  run_ranks(g2, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSyncOptions o = options(c);
    o.overlap_steps = 0;
    OuterSync sync(comm, *backend, q4_config(), o, outer_params(blocking[r]));
    for (uint64_t t = 1; t <= 14; ++t) {
      inner_step(blocking[r], r, t);
      sync.step();
    }
    without[r] = sync.stats();
  });
  for (int r = 0; r < c.world; ++r) {
    EXPECT_EQ(with[r].rounds, 4u);
    EXPECT_EQ(with[r].bytes_sent, without[r].bytes_sent);
    EXPECT_EQ(with[r].uncompressed_bytes, without[r].uncompressed_bytes);
    EXPECT_GT(with[r].background_seconds, 0.0);
    EXPECT_LE(with[r].wait_seconds, with[r].seconds);
    EXPECT_EQ(without[r].wait_seconds, 0.0);
    EXPECT_EQ(without[r].background_seconds, 0.0);
  }
}

TEST(OuterSync, OverlapRefusesTauPastTheNextSyncEagerAndBadMixing) {
  auto message = [](OuterSyncOptions o) -> std::string {
    try {
      o.validate();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  OuterSyncOptions o;
  o.inner_steps = 6;
  o.fragments = 2;
  o.overlap_steps = 2;
  EXPECT_EQ(message(o), "");
  o.overlap_steps = 3;
  EXPECT_NE(message(o).find("overlap_steps (tau) = 3 must be below"), std::string::npos);
  o.overlap_steps = 2;
  o.mixing = 1.5f;
  EXPECT_NE(message(o).find("mixing (alpha)"), std::string::npos);
  o.mixing = NAN;
  EXPECT_NE(message(o).find("mixing (alpha)"), std::string::npos);
  o.mixing = 0.5f;
  o.eager = true;
  EXPECT_NE(message(o).find("eager updates take mixing (alpha) = 0"), std::string::npos);
  o.mixing = 0.0f;
  EXPECT_EQ(message(o), "");
  o.overlap_steps = 0;
  EXPECT_NE(message(o).find("eager updates need overlap_steps (tau) > 0"), std::string::npos);
}

TEST(OuterSync, OverlapRanksWithAnotherTauAreNamedAndSyncFragmentWaitsForFlush) {
  const int world = 2;
  Params ranks = make_params(world, {64, 64});
  std::vector<std::string> errors(world);
  InProcessGroup group(world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    OuterSyncOptions o = options({world, 1, 4, 1, 0.0f});
    o.overlap_steps = r == 0 ? 1 : 2;
    OuterSync sync(comm, *backend, q4_config(), o, outer_params(ranks[r]));
    try {
      for (uint64_t t = 1; t <= 4; ++t) sync.step();
      // The agreement runs on the round's thread: its verdict comes at the merge.
      sync.flush();
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    EXPECT_EQ(sync.stats().rounds, 0u);
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("(and overlap_steps: "), std::string::npos) << e;
    EXPECT_NE(e.find("background round of fragment 0 (round 0, synced after inner step 4)"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("Nothing was allreduced: make the ranks agree"), std::string::npos) << e;
  }
  InProcessGroup solo(1);
  auto backend = make_cpu_backend();
  OuterSync sync(solo.communicator(0), *backend, q4_config(), options({1, 1, 4, 2, 0.0f}),
                 outer_params(ranks[0]));
  for (int t = 0; t < 4; ++t) sync.step();
  EXPECT_THROW(sync.sync_fragment(0), Error);
  EXPECT_TRUE(sync.flush());
  sync.sync_fragment(0);
  EXPECT_EQ(sync.stats().rounds, 2u);
}

}  // namespace
}  // namespace gradcomp
