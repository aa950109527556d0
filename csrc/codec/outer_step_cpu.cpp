// DiLoCo's outer step loops: math::outer_sgd per element, portable (SSE2) and AVX2.
#include "outer_step_cpu.h"

#include "math/outer_math.h"

#if defined(__x86_64__) || defined(_M_X64)
#define GRADCOMP_OUTER_X86 1
// A function-level target keeps AVX2 out of the rest of the library; FMA stays off (contraction
// would change the bytes).
#define GRADCOMP_OUTER_AVX2 __attribute__((target("avx2")))
#endif

namespace gradcomp {
namespace detail {
namespace {

// Inlined into each ISA's function so that each compiles the loop for its own instruction set
// (the compiler vectorizes both: -fopt-info-vec reports 16- and 32-byte vectors); nesterov a
// template argument so that the loop has no branch.
template <bool kNesterov>
__attribute__((always_inline)) inline void sgd_loop(float* __restrict anchor,
                                                    const float* __restrict gradient,
                                                    float* __restrict momentum, size_t n, float lr,
                                                    float mu) {
  for (size_t e = 0; e < n; ++e)
    anchor[e] = math::outer_sgd(anchor[e], gradient[e], &momentum[e], lr, mu, kNesterov);
}

void sgd_portable(const OuterStepRows& r) {
  if (r.nesterov)
    sgd_loop<true>(r.anchor, r.gradient, r.momentum, r.n, r.lr, r.mu);
  else
    sgd_loop<false>(r.anchor, r.gradient, r.momentum, r.n, r.lr, r.mu);
}

#if GRADCOMP_OUTER_X86
GRADCOMP_OUTER_AVX2 void sgd_avx2(const OuterStepRows& r) {
  if (r.nesterov)
    sgd_loop<true>(r.anchor, r.gradient, r.momentum, r.n, r.lr, r.mu);
  else
    sgd_loop<false>(r.anchor, r.gradient, r.momentum, r.n, r.lr, r.mu);
}
#endif

}  // namespace

void outer_sgd_rows(const OuterStepRows& rows, cpu::Isa isa) {
#if GRADCOMP_OUTER_X86
  if (isa != cpu::Isa::kPortable) return sgd_avx2(rows);
#endif
  (void)isa;
  sgd_portable(rows);
}

}  // namespace detail
}  // namespace gradcomp
