// DiLoCo's short-run warning: the rule and the measured numbers every front end quotes.
#pragma once

#include <cstdint>
#include <string>

#include "gradcomp/outer_sync.h"

namespace gradcomp {

// The outer defaults (OuterSyncOptions: lr 0.7, Nesterov momentum 0.9) are the DiLoCo papers',
// tuned on runs of tens of thousands of steps; runs of fewer rounds than this were measured to
// lose several times more to them than to outer lr 1.0, momentum 0.3 (docs/api.md, "DiLoCo's
// outer settings on short runs").
inline constexpr uint64_t kShortRunRounds = 100;

// Those measurements, as the warning quotes them.
const char* short_run_measurements();

// Whether `options` has the default outer lr and momentum: all a C++ program that never set
// them can be told apart by (the Python front end knows whether they were passed).
bool outer_defaults_kept(const OuterSyncOptions& options);

// The warning a DiLoCo front end gives once, or "" when none is due: one is due when the outer
// settings are the defaults (`defaults_kept`) and the run has fewer than kShortRunRounds rounds
// of `inner_steps`, or its length is unknown (`planned_steps` 0). Throws Error when inner_steps
// is 0.
std::string short_run_warning(bool defaults_kept, uint32_t inner_steps, uint64_t planned_steps);

}  // namespace gradcomp
