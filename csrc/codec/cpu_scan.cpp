// The CPU's scan for non-finite values in a bucket assembled from other ranks' results.
#include "gradcomp/cpu.h"
#include "params_checks.h"

namespace gradcomp {
namespace cpu {
namespace {

// Any element of `n` words whose exponent bits are all set (math::nonfinite_exponent), in a
// loop without early exit so the compiler vectorises it.
template <typename Word>
bool any_nonfinite(const Word* words, int64_t n, uint32_t mask) {
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) any |= (words[i] & mask) == mask;
  return any != 0;
}

}  // namespace

void scan_nonfinite(const NonfiniteScanParams& p) {
  ::gradcomp::detail::check_params(p, "non-finite scan");
  const uint32_t mask = math::nonfinite_exponent(p.dtype);
  for (int s = 0; s < p.num_segments; ++s) {
    const Segment& seg = p.segments[s];
    const bool bad = p.dtype == math::kDtypeF32
                         ? any_nonfinite(static_cast<const uint32_t*>(seg.data), seg.numel, mask)
                         : any_nonfinite(static_cast<const uint16_t*>(seg.data), seg.numel, mask);
    if (bad) {
      *p.nonfinite = 1;
      return;
    }
  }
}

}  // namespace cpu
}  // namespace gradcomp
