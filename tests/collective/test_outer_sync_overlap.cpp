// Streaming DiLoCo's overlap with in-process ranks: rounds merged tau steps late with mixing alpha
// (or eagerly) equal a sequential reference of the same rule, allocate nothing once warm, and
// resume bit for bit with a round in flight.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/forwarding_backend.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/outer_sync.h"
#include "outer_sync_overlap_reference.h"

namespace gradcomp {
namespace {

using testing::Case;
using testing::inner_step;
using testing::make_params;
using testing::name;
using testing::options;
using testing::outer_params;
using testing::Params;
using testing::q4_config;
using testing::reference_run;
using testing::run_ranks;

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

}  // namespace
}  // namespace gradcomp
