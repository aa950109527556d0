// DiLoCo's short-run warning: when it is due, and the numbers it quotes.
#include <gtest/gtest.h>

#include <string>

#include "gradcomp/outer_short_run.h"

namespace gradcomp {
namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(ShortRunWarning, DueBelowOneHundredRoundsOrWhenTheLengthIsUnknown) {
  const std::string unknown = short_run_warning(true, 20, 0);
  EXPECT_TRUE(has(unknown, "the run's length is unknown (planned_steps not given)")) << unknown;
  EXPECT_TRUE(has(unknown, short_run_measurements())) << unknown;
  EXPECT_TRUE(has(unknown, "outer_lr=1.0, outer_momentum=0.3")) << unknown;
  // Both LMs of bench/convergence.py (docs/api.md's table), and the user's report beside them.
  EXPECT_TRUE(has(unknown, "+6.5 % loss above dense after 300 steps at H = 20")) << unknown;
  EXPECT_TRUE(has(unknown,
                  "second LM (lm2: another architecture and text, 300 steps, 3 seeds): "
                  "+11.6 % against +1.0 %"))
      << unknown;
  EXPECT_TRUE(has(unknown, "a user's LM: +17.8 % against +5.6 %")) << unknown;
  EXPECT_TRUE(
      has(unknown, "first LM: +0.5 % against +2.0 %, but not on lm2: +4.0 % against +2.7 %"))
      << unknown;
  EXPECT_TRUE(has(unknown, ">= 100 rounds")) << unknown;
  const std::string fifteen = short_run_warning(true, 20, 300);
  EXPECT_TRUE(has(fifteen, "a run of 15 rounds (300 steps at H = 20)")) << fifteen;
  // The boundary: 99 rounds (and a partial 100th) warn, 100 rounds do not.
  EXPECT_TRUE(
      has(short_run_warning(true, 100, 9999), "a run of 99 rounds (9999 steps at H = 100)"));
  EXPECT_TRUE(has(short_run_warning(true, 20, 1999), "a run of 99 rounds"));
  EXPECT_EQ(short_run_warning(true, 100, 10000), "");
  EXPECT_EQ(short_run_warning(true, 20, 2000), "");
  EXPECT_EQ(short_run_warning(true, 1, 100), "");
  EXPECT_TRUE(has(short_run_warning(true, 1, 99), "a run of 99 rounds"));
  EXPECT_TRUE(has(short_run_warning(true, 50, 49), "a run of 0 rounds (49 steps at H = 50)"));
}

TEST(ShortRunWarning, ChosenOuterSettingsSilenceIt) {
  EXPECT_EQ(short_run_warning(false, 20, 0), "");
  EXPECT_EQ(short_run_warning(false, 20, 300), "");
  OuterSyncOptions o;
  EXPECT_TRUE(outer_defaults_kept(o));
  o.outer_lr = 1.0f;
  EXPECT_FALSE(outer_defaults_kept(o));
  o = OuterSyncOptions{};
  o.outer_momentum = 0.3f;
  EXPECT_FALSE(outer_defaults_kept(o));
  o = OuterSyncOptions{};
  o.inner_steps = 20;  // H and the other settings are not the outer optimizer's
  o.fragments = 2;
  EXPECT_TRUE(outer_defaults_kept(o));
}

TEST(ShortRunWarning, RefusesZeroInnerSteps) {
  try {
    short_run_warning(true, 0, 300);
    ADD_FAILURE() << "inner_steps 0 accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "inner_steps must be >= 1, got 0")) << e.what();
  }
}

}  // namespace
}  // namespace gradcomp
