// Streaming DiLoCo's overlap when things go wrong or are asked about: a non-finite mean at the
// merge, a round that fails, ranks that disagree, refused options, and the stats it reports.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/fault_injection.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/outer_sync.h"
#include "outer_sync_overlap_reference.h"

namespace gradcomp {
namespace {

using testing::Case;
using testing::inner_step;
using testing::make_params;
using testing::options;
using testing::outer_params;
using testing::Params;
using testing::q4_config;
using testing::run_ranks;

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
