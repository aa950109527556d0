// CPU top-k codec: exact radix select or sampled threshold, ordered compaction, sparse decode.
#include <algorithm>
#include <functional>
#include <memory>
#include <sstream>
#include <vector>

#include "cpu_codec_util.h"
#include "gradcomp/cpu.h"
#include "params_checks.h"

namespace gradcomp {
namespace cpu {
namespace {

using format::PayloadHeader;

float load_residual(const void* r, int64_t i, uint8_t dtype) {
  return r ? math::load_as_float(r, i, dtype) : 0.0f;
}

// Four interleaved first-pass histograms, so runs of equal digits (gradients share exponents) do
// not serialize on one counter.
constexpr int kHistCopies = 4;

// Scans skip blocks of this many elements whose keys are all below a bound: with 1 % selected,
// most blocks, and the test vectorizes where the per-element work does not.
constexpr int64_t kScanBlock = 16;

// Whether any of the kScanBlock keys at x reaches `bound`. Keys and bound are below 2^31, so
// bound - 1 - key has its top bit set exactly when key >= bound: subtract, or and shift, which
// vectorize on any x86-64 (no 32-bit compare or max needed).
bool any_key_at_least(const float* x, uint32_t bound) {
  uint32_t hit = 0;
  for (int64_t j = 0; j < kScanBlock; ++j) {
    uint32_t bits;
    std::memcpy(&bits, x + j, sizeof bits);
    hit |= bound - 1u - (bits & 0x7FFFFFFFu);
  }
  return (hit >> 31) != 0;
}

// Calls f(i) for every i in [0, n) whose key reaches `bound`, in order.
template <typename F>
void for_keys_at_least(const float* acc, int64_t n, uint32_t bound, F&& f) {
  for (int64_t i0 = 0; i0 < n; i0 += kScanBlock) {
    const int64_t i1 = std::min(n, i0 + kScanBlock);
    if (i1 - i0 == kScanBlock && !any_key_at_least(acc + i0, bound)) continue;
    for (int64_t i = i0; i < i1; ++i)
      if (math::topk_key(acc[i]) >= bound) f(i);
  }
}

// acc = input + residual over elements [begin, begin + n) of the view (a residual of zeros
// when there is none: the add still turns -0 into +0, as on the GPU). With `hist`, also counts
// the keys' first radix digits while each staged run is still in cache (the exact threshold's
// first pass, without a pass of its own over acc).
void load_sums(const detail::SegmentView& input, int64_t begin, const void* residual, uint8_t dtype,
               int64_t n, float* acc, uint32_t* hist) {
  float r[detail::kStagingElements];
  for (int64_t s = 0; s < n; s += detail::kStagingElements) {
    const int64_t len = std::min<int64_t>(detail::kStagingElements, n - s);
    const float* x = input.fp32_run(begin + s, len);
    if (x == nullptr) {
      input.gather(begin + s, len, acc + s);
      x = acc + s;
    }
    if (residual != nullptr) {
      detail::load_floats(residual, s, len, dtype, r);
    } else {
      std::fill(r, r + len, 0.0f);
    }
    for (int64_t j = 0; j < len; ++j) acc[s + j] = math::add_rn(x[j], r[j]);
    if (hist == nullptr) continue;
    for (int64_t j = 0; j < len; ++j)
      ++hist[(j & (kHistCopies - 1)) * math::kTopKMaxBins +
             math::topk_digit(math::topk_key(acc[s + j]), 0)];
  }
}

// The approximate-mode threshold: the sample's m-th largest key, as the CUDA kernel finds it.
uint32_t topk_sample_threshold(const float* acc, int64_t n, int64_t k) {
  const int64_t samples = math::topk_sample_size(n);
  std::vector<uint32_t> sample(static_cast<size_t>(samples));
  for (int64_t j = 0; j < samples; ++j)
    sample[j] = math::topk_key(acc[math::topk_sample_index(j, n, samples)]);
  const int64_t m = math::topk_sample_rank(k, n, samples);
  std::nth_element(sample.begin(), sample.begin() + (m - 1), sample.end(),
                   std::greater<uint32_t>());
  return sample[m - 1];
}

// The exact threshold key and how many elements equal to it are selected: the CUDA kernel's
// radix passes (11, 11 and 9 bits), with the same result. The first pass's histogram comes from
// load_sums (`hist`: kHistCopies interleaved copies); the later passes count only the keys whose
// first digit was chosen, gathered once.
void topk_exact_threshold(const float* acc, int64_t n, int64_t k, std::vector<uint32_t>& hist,
                          uint32_t* threshold, uint64_t* eq_limit) {
  if (k == 0) {
    *threshold = 0xFFFFFFFFu;  // selects nothing
    *eq_limit = 0;
    return;
  }
  constexpr int kBins = math::kTopKMaxBins;
  for (int c = 1; c < kHistCopies; ++c)
    for (int d = 0; d < kBins; ++d) hist[d] += hist[c * kBins + d];
  uint64_t remaining = static_cast<uint64_t>(k), above = 0;
  uint32_t prefix = math::topk_choose_digit(hist.data(), kBins, remaining, &above)
                    << math::topk_pass_shift(0);
  remaining -= above;
  std::vector<uint32_t> candidates;
  // Keys with the chosen first digit are at least the prefix.
  for_keys_at_least(acc, n, prefix, [&](int64_t i) {
    const uint32_t key = math::topk_key(acc[i]);
    if ((key & math::topk_pass_mask_above(1)) == prefix) candidates.push_back(key);
  });
  for (int pass = 1; pass < math::kTopKPasses; ++pass) {
    const uint32_t mask = math::topk_pass_mask_above(pass);
    std::fill(hist.begin(), hist.begin() + kBins, 0u);
    for (uint32_t key : candidates)
      if ((key & mask) == prefix) ++hist[math::topk_digit(key, pass)];
    const uint32_t digit =
        math::topk_choose_digit(hist.data(), math::topk_pass_bins(pass), remaining, &above);
    remaining -= above;
    prefix |= digit << math::topk_pass_shift(pass);
  }
  *threshold = prefix;
  *eq_limit = remaining;
}

}  // namespace

uint64_t topk_encode(const TopKEncodeParams& p) {
  ::gradcomp::detail::check_params(p, "top-k encode");
  const int64_t n = p.numel;
  // acc is most elements' new residual, so an fp32 residual_out that does not overlap residual_in
  // holds it from the start: no copy of the whole bucket at the end, only the selected and
  // non-finite elements' fixes.
  const auto* out_bytes = static_cast<const char*>(p.residual_out);
  const auto* in_bytes = static_cast<const char*>(p.residual_in);
  const size_t residual_bytes = static_cast<size_t>(n) * 4;
  const bool acc_in_residual =
      p.residual_out != nullptr && p.residual_dtype == math::kDtypeF32 &&
      (in_bytes == nullptr || out_bytes + residual_bytes <= in_bytes ||
       in_bytes + static_cast<size_t>(n) * math::dtype_bytes(p.residual_dtype) <= out_bytes);
  std::unique_ptr<float[]> own;
  float* acc =
      acc_in_residual ? static_cast<float*>(p.residual_out) : static_cast<float*>(p.workspace);
  if (acc == nullptr) {
    own.reset(new float[static_cast<size_t>(n)]);
    acc = own.get();
  }
  std::vector<uint32_t> hist(p.exact ? kHistCopies * math::kTopKMaxBins : 0, 0u);
  load_sums(detail::SegmentView(p.segments, p.num_segments, p.dtype), p.begin, p.residual_in,
            p.residual_dtype, n, acc, p.exact ? hist.data() : nullptr);

  uint32_t threshold = 0;
  uint64_t eq_limit = ~uint64_t{0};
  if (p.exact) {
    topk_exact_threshold(acc, n, p.k, hist, &threshold, &eq_limit);
  } else if (n > 0) {
    threshold = topk_sample_threshold(acc, n, p.k);
  }

  const PayloadHeader h0 = format::make_topk_header(n, p.capacity, 0, p.dtype, p.value_dtype);
  uint32_t* indices = reinterpret_cast<uint32_t*>(p.payload + kPayloadHeaderBytes);
  uint8_t* values = p.payload + format::section1_offset(h0);
  std::memset(indices, 0, h0.section0_bytes);
  std::memset(values, 0, h0.section1_bytes);
  // Only elements at or above the threshold can be selected or counted, and only non-finite
  // ones keep their old residual: the rest keep acc as their residual. Their residuals are
  // noted here and written after the bulk copy, since residual_in may alias residual_out.
  struct ResidualFix {
    int64_t index;
    float residual;
  };
  std::vector<ResidualFix> fixes;
  const uint32_t visit_from = std::min(threshold, 0x7F800000u);
  uint64_t gt = 0, eq = 0, written = 0;
  for_keys_at_least(acc, n, visit_from, [&](int64_t i) {
    const uint32_t key = math::topk_key(acc[i]);
    const bool selected = key > threshold || (key == threshold && eq < eq_limit);
    const uint64_t pos = gt + std::min(eq, eq_limit);
    if (key > threshold) ++gt;
    if (key == threshold) ++eq;
    float residual = acc[i];
    bool changed = false;
    if (selected && pos < p.capacity) {
      const float v = math::topk_value_round(acc[i], p.value_dtype);
      indices[pos] = static_cast<uint32_t>(i);
      math::store_from_float(values, static_cast<int64_t>(pos), p.value_dtype, v);
      residual = math::sub_rn(acc[i], v);
      changed = true;
      written = pos + 1;
    }
    if (!math::is_finite_bits(key)) {
      residual = load_residual(p.residual_in, i, p.residual_dtype);
      changed = true;
    }
    if (changed && p.residual_out != nullptr) fixes.push_back({i, residual});
  });
  if (p.residual_out != nullptr) {
    if (!acc_in_residual) detail::store_floats(p.residual_out, 0, n, p.residual_dtype, acc);
    for (const ResidualFix& f : fixes)
      math::store_from_float(p.residual_out, f.index, p.residual_dtype, f.residual);
  }
  format::seal_payload(p.payload,
                       format::make_topk_header(n, p.capacity, written, p.dtype, p.value_dtype));
  return written;
}

void topk_decode(const TopKDecodeParams& p) {
  ::gradcomp::detail::check_params(p, "top-k decode");
  detail::validate_payloads(
      p.payloads, p.num_payloads, p.payload_bytes, format::kCodecTopK, [&](int) { return p.numel; },
      p.capacity, p.value_dtype, "top-k decode");
  for (int w = 0; w < p.num_payloads; ++w) {
    const PayloadHeader h = format::read_header(p.payloads[w]);
    const uint32_t* idx = reinterpret_cast<const uint32_t*>(p.payloads[w] + kPayloadHeaderBytes);
    // Bad indices under a good checksum are a sender's bytes all the same: a PayloadError, so that
    // rejected_payloads counts them as on the CUDA path.
    for (uint64_t e = 0; e < h.count; ++e) {
      const bool in_range = idx[e] < static_cast<uint64_t>(p.numel);
      if (in_range && (e == 0 || idx[e] > idx[e - 1])) continue;
      std::ostringstream m;
      m << "top-k decode: payload " << w << " (from rank " << w << ") rejected: entry " << e;
      if (!in_range)
        m << " has index " << idx[e] << " outside [0, " << p.numel << ")";
      else
        m << " breaks the strictly increasing index order";
      throw PayloadError(m.str());
    }
  }
  // An element no payload selected is 0 / divisor, so the output is filled with that and only
  // the selected elements are summed: window by window of the bucket (the output's window is
  // filled, then overwritten where selected, while in cache), in a zeroed fp32 window in L1, each
  // payload's entries in the window added in rank order (as a dense scatter-add would add them),
  // then divided into the output. When 0 / divisor is not finite (a divisor of 0 or NaN), no mean
  // is, so any output is flagged.
  const detail::SegmentView out(p.segments, p.num_segments, p.dtype);
  const float zero = math::div_rn(0.0f, p.divisor);
  struct Entries {
    const uint32_t* index;
    const uint8_t* values;
    uint64_t count, at;
  };
  std::vector<Entries> payloads;
  for (int w = 0; w < p.num_payloads; ++w) {
    const PayloadHeader h = format::read_header(p.payloads[w]);
    payloads.push_back({reinterpret_cast<const uint32_t*>(p.payloads[w] + kPayloadHeaderBytes),
                        p.payloads[w] + format::section1_offset(h), h.count, 0});
  }
  float* direct = out.fp32_run(p.begin, p.numel);
  bool nonfinite = p.numel > 0 && !math::is_finite_bits(math::float_bits(zero));
  float window[detail::kStagingElements];
  for (int64_t lo = 0; lo < p.numel; lo += detail::kStagingElements) {
    const uint64_t hi = static_cast<uint64_t>(std::min(lo + detail::kStagingElements, p.numel));
    std::fill(window, window + (hi - lo), 0.0f);
    out.fill(p.begin + lo, static_cast<int64_t>(hi) - lo, zero);
    for (const Entries& w : payloads)
      for (uint64_t e = w.at; e < w.count && w.index[e] < hi; ++e) {
        float& sum = window[w.index[e] - lo];
        sum = math::add_rn(sum,
                           math::load_as_float(w.values, static_cast<int64_t>(e), p.value_dtype));
      }
    for (Entries& w : payloads) {
      for (; w.at < w.count && w.index[w.at] < hi; ++w.at) {
        const uint32_t i = w.index[w.at];
        const float mean = math::div_rn(window[i - lo], p.divisor);
        nonfinite |= !math::is_finite_bits(math::float_bits(mean));
        if (direct != nullptr) {
          direct[i] = mean;
        } else {
          out.store(p.begin + i, mean);
        }
      }
    }
  }
  if (p.nonfinite != nullptr && nonfinite) *p.nonfinite = 1;
}

}  // namespace cpu
}  // namespace gradcomp
