// DiLoCo's short-run warning: defaults kept and fewer than kShortRunRounds rounds (or unknown).
#include "gradcomp/outer_short_run.h"

#include <sstream>

namespace gradcomp {

const char* short_run_measurements() {
  return "+6.5 % loss above dense after 300 steps at H = 20 (15 rounds; +8.6 % after 400 steps, "
         "3 seeds) on bench/convergence.py's LM, against +2.2 % (+3.4 %) with outer_lr=1.0, "
         "outer_momentum=0.3; on its second LM (lm2: another architecture and text, 300 steps, "
         "3 seeds): +11.6 % against +1.0 %; a user's LM: +17.8 % against +5.6 %. Started from a "
         "dense checkpoint instead (20 rounds at H = 20, 3 seeds) the defaults did better on the "
         "first LM: +0.5 % against +2.0 %, but not on lm2: +4.0 % against +2.7 %";
}

bool outer_defaults_kept(const OuterSyncOptions& options) {
  const OuterSyncOptions defaults;
  return options.outer_lr == defaults.outer_lr && options.outer_momentum == defaults.outer_momentum;
}

std::string short_run_warning(bool defaults_kept, uint32_t inner_steps, uint64_t planned_steps) {
  GRADCOMP_CHECK(inner_steps >= 1, "DiLoCo inner_steps must be >= 1, got 0");
  if (!defaults_kept) return std::string();
  const uint64_t rounds = planned_steps / inner_steps;
  if (planned_steps != 0 && rounds >= kShortRunRounds) return std::string();
  std::ostringstream s;
  s << "gradcomp DiLoCo: the default outer settings (outer_lr=0.7, outer_momentum=0.9, Nesterov: "
       "the DiLoCo papers', for long runs of tens of thousands of steps) ";
  if (planned_steps == 0)
    s << "are kept, and the run's length is unknown (planned_steps not given)";
  else
    s << "are kept for a run of " << rounds << " rounds (" << planned_steps
      << " steps at H = " << inner_steps << ")";
  s << ". On short runs from scratch they were measured at " << short_run_measurements()
    << ". Set outer_lr and outer_momentum (e.g. outer_lr=1.0, outer_momentum=0.3) to choose, or "
       "planned_steps (the run's inner steps) when it has >= "
    << kShortRunRounds << " rounds (docs/api.md, \"DiLoCo's outer settings on short runs\")";
  return s.str();
}

}  // namespace gradcomp
