// DiLoCo's outer Nesterov step over a fragment on the host, in vectorized loops.
#pragma once

#include <cstddef>

#include "gradcomp/cpu.h"

namespace gradcomp {
namespace detail {

// anchor[e] = math::outer_sgd(anchor[e], gradient[e], &momentum[e], lr, mu, nesterov) for e < n;
// the three arrays must not overlap.
struct OuterStepRows {
  float* anchor = nullptr;
  const float* gradient = nullptr;
  float* momentum = nullptr;
  size_t n = 0;
  float lr = 0.0f, mu = 0.0f;
  bool nesterov = true;
};

// The loop compiled for `isa` (kAvx512 takes the AVX2 loop): each writes the bytes of the scalar
// rule, since every lane runs the same rounded operations (no FMA, the same NaN canonicalisation).
void outer_sgd_rows(const OuterStepRows& rows, cpu::Isa isa);
// The fastest loop of cpu::active_isa() (GRADCOMP's process-wide choice, as the q4 codec's).
inline void outer_sgd_rows(const OuterStepRows& rows) {
  outer_sgd_rows(rows, cpu::active_isa());
}

}  // namespace detail
}  // namespace gradcomp
