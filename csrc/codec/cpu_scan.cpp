// The CPU's scan for non-finite values in a bucket assembled from other ranks' results.
#include <algorithm>

#include "cpu_codec_util.h"
#include "gradcomp/cpu.h"
#include "params_checks.h"

namespace gradcomp {
namespace cpu {

void scan_nonfinite(const NonfiniteScanParams& p) {
  ::gradcomp::detail::check_params(p, "non-finite scan");
  if (p.numel == 0) return;
  const detail::SegmentView view(p.segments, p.num_segments, p.dtype);
  const int64_t first = p.segments[0].offset;
  float v[detail::kStagingElements];
  for (int64_t s = 0; s < p.numel; s += detail::kStagingElements) {
    const int64_t len = std::min<int64_t>(detail::kStagingElements, p.numel - s);
    view.gather(first + s, len, v);
    for (int64_t j = 0; j < len; ++j) {
      if (!math::is_finite_bits(math::float_bits(v[j]))) {
        *p.nonfinite = 1;
        return;
      }
    }
  }
}

}  // namespace cpu
}  // namespace gradcomp
