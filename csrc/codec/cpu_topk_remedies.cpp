// CPU reference of DGC's top-k remedies: local clipping, momentum correction, factor masking.
#include <algorithm>
#include <vector>

#include "cpu_codec_util.h"
#include "gradcomp/cpu.h"
#include "params_checks.h"

namespace gradcomp {
namespace cpu {

void topk_accumulate(const TopKAccumulateParams& p) {
  ::gradcomp::detail::check_params(p, "top-k accumulate");
  const detail::SegmentView input(p.segments, p.num_segments, p.dtype);
  const int64_t n = p.numel;
  float scale = 1.0f;
  if (p.clip_threshold > 0.0f) {
    float g[math::kTopKClipChunk];
    float total = 0.0f;
    for (int64_t c = 0; c < math::topk_clip_chunks(n); ++c) {
      const int64_t first = c * math::kTopKClipChunk;
      const int64_t len = std::min<int64_t>(math::kTopKClipChunk, n - first);
      input.gather(first, len, g);
      float sum = 0.0f;
      for (int64_t j = 0; j < len; ++j) sum = math::topk_clip_sum(sum, g[j]);
      total = math::add_rn(total, sum);
    }
    scale = math::topk_clip_scale(total, p.clip_threshold);
  }
  float g[detail::kStagingElements];
  for (int64_t s = 0; s < n; s += detail::kStagingElements) {
    const int64_t len = std::min<int64_t>(detail::kStagingElements, n - s);
    input.gather(s, len, g);
    for (int64_t j = 0; j < len; ++j)
      p.out[s + j] = math::topk_accumulate_element(g[j], scale, p.momentum, p.velocity_in, s + j);
  }
}

void topk_mask(const TopKMaskParams& p) {
  ::gradcomp::detail::check_params(p, "top-k mask");
  const format::PayloadHeader h = format::read_header(p.payload);
  const uint64_t count = std::min<uint64_t>(h.count, p.capacity);
  const uint32_t* idx = reinterpret_cast<const uint32_t*>(p.payload + kPayloadHeaderBytes);
  for (uint64_t e = 0; e < count; ++e)
    if (idx[e] < static_cast<uint64_t>(p.numel)) p.target[idx[e]] = 0.0f;
}

}  // namespace cpu
}  // namespace gradcomp
