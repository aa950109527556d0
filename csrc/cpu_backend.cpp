// CPU reference backend: q4 and top-k encode/decode over flattened segment lists.
#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "cpu_q4_loops.h"
#include "element_math.h"
#include "gradcomp/cpu.h"
#include "gradcomp/format.h"
#include "segment_checks.h"

namespace gradcomp {
namespace cpu {
namespace {

using ::gradcomp::detail::check_segments;
using math::PayloadHeader;

// Converts n elements starting at base[first] to fp32; the dtype branch stays out of the loop.
void load_floats(const void* base, int64_t first, int64_t n, uint8_t dtype, float* out) {
  if (dtype == math::kDtypeF32) {
    std::memcpy(out, static_cast<const float*>(base) + first, static_cast<size_t>(n) * 4);
  } else if (dtype == math::kDtypeF16) {
    const uint16_t* in = static_cast<const uint16_t*>(base) + first;
    for (int64_t i = 0; i < n; ++i) out[i] = math::half_to_float(in[i]);
  } else {
    const uint16_t* in = static_cast<const uint16_t*>(base) + first;
    for (int64_t i = 0; i < n; ++i) out[i] = math::bf16_to_float(in[i]);
  }
}

void store_floats(void* base, int64_t first, int64_t n, uint8_t dtype, const float* in) {
  if (dtype == math::kDtypeF32) {
    std::memcpy(static_cast<float*>(base) + first, in, static_cast<size_t>(n) * 4);
  } else if (dtype == math::kDtypeF16) {
    uint16_t* out = static_cast<uint16_t*>(base) + first;
    for (int64_t i = 0; i < n; ++i) out[i] = math::float_to_half(in[i]);
  } else {
    uint16_t* out = static_cast<uint16_t*>(base) + first;
    for (int64_t i = 0; i < n; ++i) out[i] = math::float_to_bf16(in[i]);
  }
}

// Reads and writes elements of a flattened segment list in contiguous runs.
class SegmentView {
 public:
  SegmentView(const Segment* segments, int count, uint8_t dtype)
      : segments_(segments), count_(count), dtype_(dtype) {}

  // Copies elements [first, first + n) of the flattened view into out as fp32.
  void gather(int64_t first, int64_t n, float* out) const {
    for_runs(first, n, [&](const Segment& s, int64_t local, int64_t done, int64_t len) {
      load_floats(s.data, local, len, dtype_, out + done);
    });
  }

  // Elements [first, first + n) as a pointer into one fp32 segment, or null when they are
  // another dtype or span segments (then gather / scatter through a staging buffer).
  float* fp32_run(int64_t first, int64_t n) const {
    return dtype_ == math::kDtypeF32 ? static_cast<float*>(run(first, n)) : nullptr;
  }

  // Elements [first, first + n) as raw memory of one segment (of the view's dtype), or null.
  void* run(int64_t first, int64_t n) const {
    if (n == 0) return nullptr;
    const Segment* end = segments_ + count_;
    const Segment* s = std::upper_bound(
        segments_, end, first, [](int64_t v, const Segment& seg) { return v < seg.offset; });
    if (s == segments_) return nullptr;
    --s;
    if (first < s->offset || first + n > s->offset + s->numel) return nullptr;
    return static_cast<char*>(s->data) +
           (first - s->offset) * static_cast<int64_t>(dtype_size(static_cast<DType>(dtype_)));
  }

  // Writes fp32 values to elements [first, first + n), rounding to the view's dtype.
  void scatter(int64_t first, int64_t n, const float* in) const {
    for_runs(first, n, [&](const Segment& s, int64_t local, int64_t done, int64_t len) {
      store_floats(s.data, local, len, dtype_, in + done);
    });
  }

 private:
  template <typename F>
  void for_runs(int64_t first, int64_t n, F&& f) const {
    if (n == 0) return;
    const Segment* end = segments_ + count_;
    const Segment* s = std::upper_bound(
        segments_, end, first, [](int64_t v, const Segment& seg) { return v < seg.offset; });
    GRADCOMP_CHECK(s != segments_, "element " << first << " lies before the first segment");
    --s;
    int64_t done = 0;
    while (done < n) {
      GRADCOMP_CHECK(s != end, "element " << first + done << " lies past the last segment");
      int64_t local = first + done - s->offset;
      int64_t len = std::min(n - done, s->numel - local);
      if (len > 0) {
        f(*s, local, done, len);
        done += len;
      }
      ++s;
    }
  }

  const Segment* segments_;
  int count_;
  uint8_t dtype_;
};

void check_dtype(uint8_t d, const char* what) {
  GRADCOMP_CHECK(d <= math::kDtypeBF16, what << ": invalid dtype code " << int(d));
}

// Writes the header and zeroes the alignment padding after each section, so a payload's bytes
// are fully determined by its contents.
void write_header(uint8_t* payload, const PayloadHeader& h) {
  std::memcpy(payload, &h, sizeof h);
  const uint64_t s0_end = math::kHeaderBytes + h.section0_bytes;
  const uint64_t s1 = math::section1_offset(h);
  std::memset(payload + s0_end, 0, s1 - s0_end);
  std::memset(payload + s1 + h.section1_bytes, 0,
              math::payload_bytes_of(h) - s1 - h.section1_bytes);
}

PayloadHeader read_header(const uint8_t* payload) {
  PayloadHeader h;
  std::memcpy(&h, payload, sizeof h);
  return h;
}

void validate_payloads(const uint8_t* const* payloads, int num_payloads, uint64_t payload_bytes,
                       uint8_t codec, uint64_t numel, uint32_t param, uint8_t value_dtype,
                       const char* what) {
  GRADCOMP_CHECK(num_payloads >= 1 && payloads != nullptr, what << ": no payloads");
  for (int w = 0; w < num_payloads; ++w) {
    GRADCOMP_CHECK(payloads[w] != nullptr, what << ": payload " << w << " is null");
    GRADCOMP_CHECK(payload_bytes >= math::kHeaderBytes,
                   what << ": payload " << w << " has " << payload_bytes
                        << " bytes, fewer than the 64-byte header");
    int status = math::check_header(read_header(payloads[w]), codec, numel, param, value_dtype,
                                    payload_bytes);
    GRADCOMP_CHECK(status == math::kHeaderOk,
                   what << ": payload " << w << " (from rank " << w
                        << ") rejected: " << header_status_message(status));
  }
}

float load_residual(const void* r, int64_t i, uint8_t dtype) {
  return r ? math::load_as_float(r, i, dtype) : 0.0f;
}

// acc = input + residual over elements [begin, begin + n) of the view (a residual of zeros
// when there is none: the add still turns -0 into +0, as on the GPU).
void load_sums(const SegmentView& input, int64_t begin, const void* residual, uint8_t dtype,
               int64_t n, float* acc) {
  float r[detail::kQ4ChunkElements];
  for (int64_t s = 0; s < n; s += detail::kQ4ChunkElements) {
    const int64_t len = std::min<int64_t>(detail::kQ4ChunkElements, n - s);
    const float* x = input.fp32_run(begin + s, len);
    if (x == nullptr) {
      input.gather(begin + s, len, acc + s);
      x = acc + s;
    }
    if (residual != nullptr) {
      load_floats(residual, s, len, dtype, r);
    } else {
      std::fill(r, r + len, 0.0f);
    }
    for (int64_t j = 0; j < len; ++j) acc[s + j] = math::add_rn(x[j], r[j]);
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
// radix passes (11, 11 and 9 bits), with the same result. The first pass histograms every key;
// the later passes only the keys whose first digit was chosen, gathered once.
void topk_exact_threshold(const float* acc, int64_t n, int64_t k, uint32_t* threshold,
                          uint64_t* eq_limit) {
  if (k == 0) {
    *threshold = 0xFFFFFFFFu;  // selects nothing
    *eq_limit = 0;
    return;
  }
  // Four interleaved histograms, so runs of equal digits (gradients share exponents) do not
  // serialize on one counter.
  constexpr int kCopies = 4, kBins = 2048;
  std::vector<uint32_t> hist(kCopies * kBins, 0u);
  for (int64_t i = 0; i < n; ++i)
    ++hist[(i & (kCopies - 1)) * kBins + math::topk_digit(math::topk_key(acc[i]), 0)];
  for (int c = 1; c < kCopies; ++c)
    for (int d = 0; d < kBins; ++d) hist[d] += hist[c * kBins + d];
  uint64_t remaining = static_cast<uint64_t>(k), above = 0;
  uint32_t prefix = math::topk_choose_digit(hist.data(), kBins, remaining, &above)
                    << math::topk_pass_shift(0);
  remaining -= above;
  std::vector<uint32_t> candidates;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = math::topk_key(acc[i]);
    if ((key & math::topk_pass_mask_above(1)) == prefix) candidates.push_back(key);
  }
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

void q4_encode(const Q4EncodeParams& p, int num_threads) {
  Q4Options{static_cast<int>(p.block_size)}.validate();
  check_dtype(p.dtype, "q4 encode");
  check_dtype(p.residual_dtype, "q4 encode residual");
  check_segments(p.segments, p.num_segments, p.begin, p.numel, "q4 encode");
  GRADCOMP_CHECK(p.begin % p.block_size == 0,
                 "q4 encode: range start " << p.begin << " is not a multiple of the block size "
                                           << p.block_size);
  GRADCOMP_CHECK(p.payload != nullptr, "q4 encode: payload is null");
  const PayloadHeader h = math::make_q4_header(p.numel, p.block_size, p.dtype, p.stochastic);
  write_header(p.payload, h);
  float* scales = reinterpret_cast<float*>(p.payload + math::kHeaderBytes);
  uint8_t* codes = p.payload + math::section1_offset(h);
  const int64_t chunk_size = detail::kQ4ChunkElements;
  const int64_t nchunks = (p.numel + chunk_size - 1) / chunk_size;
  const bool f32_residual = p.residual_dtype == math::kDtypeF32;
  const int input_stride = static_cast<int>(dtype_size(static_cast<DType>(p.dtype)));
  const int residual_stride = static_cast<int>(dtype_size(static_cast<DType>(p.residual_dtype)));
  const Isa isa = active_isa();
  SegmentView input(p.segments, p.num_segments, p.dtype);

#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
  {
    // Staging for inputs that are not one fp32 run, and for 16-bit residuals.
    std::vector<float> input_f32, residual_in_f32, residual_out_f32;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t start = c * chunk_size;
      const int n = static_cast<int>(std::min(chunk_size, p.numel - start));
      detail::Q4EncodeChunk chunk;
      chunk.input = input.fp32_run(p.begin + start, n);
      if (chunk.input == nullptr) {
        input_f32.resize(chunk_size);
        input.gather(p.begin + start, n, input_f32.data());
        chunk.input = input_f32.data();
      }
      if (c + 1 < nchunks) {
        const int64_t next_n = std::min(chunk_size, p.numel - start - chunk_size);
        chunk.next_input = input.run(p.begin + start + chunk_size, next_n);
        chunk.next_input_stride = input_stride;
        if (p.residual_in != nullptr) {
          chunk.next_residual_stride = residual_stride;
          chunk.next_residual_in =
              static_cast<const char*>(p.residual_in) + (start + chunk_size) * residual_stride;
        }
      }
      if (p.residual_in != nullptr && f32_residual) {
        chunk.residual_in = static_cast<const float*>(p.residual_in) + start;
      } else if (p.residual_in != nullptr) {
        residual_in_f32.resize(chunk_size);
        load_floats(p.residual_in, start, n, p.residual_dtype, residual_in_f32.data());
        chunk.residual_in = residual_in_f32.data();
      }
      if (p.residual_out != nullptr && f32_residual) {
        chunk.residual_out = static_cast<float*>(p.residual_out) + start;
      } else if (p.residual_out != nullptr) {
        residual_out_f32.resize(chunk_size);
        chunk.residual_out = residual_out_f32.data();
      }
      chunk.scales = scales + start / p.block_size;
      chunk.codes = codes + start / 2;
      chunk.first_element = p.begin + start;
      chunk.n = n;
      chunk.block = static_cast<int>(p.block_size);
      chunk.stochastic = p.stochastic;
      chunk.rng = p.rng;
      detail::q4_encode_chunk(chunk, isa);
      if (p.residual_out != nullptr && !f32_residual)
        store_floats(p.residual_out, start, n, p.residual_dtype, chunk.residual_out);
    }
  }
}

void q4_decode(const Q4DecodeParams& p, int num_threads) {
  Q4Options{static_cast<int>(p.block_size)}.validate();
  check_dtype(p.dtype, "q4 decode");
  check_segments(p.segments, p.num_segments, p.begin, p.numel, "q4 decode");
  validate_payloads(p.payloads, p.num_payloads, p.payload_bytes, math::kCodecQ4, p.numel,
                    p.block_size, math::kDtypeF32, "q4 decode");
  const PayloadHeader h = read_header(p.payloads[0]);
  const uint64_t codes_at = math::section1_offset(h);
  const int64_t chunk_size = detail::kQ4ChunkElements;
  const int64_t nchunks = (p.numel + chunk_size - 1) / chunk_size;
  const Isa isa = active_isa();
  SegmentView output(p.segments, p.num_segments, p.dtype);
  bool nonfinite = false;

#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(|| : nonfinite)
  {
    std::vector<float> sum_f32;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t start = c * chunk_size;
      const int n = static_cast<int>(std::min(chunk_size, p.numel - start));
      detail::Q4DecodeChunk chunk;
      chunk.payloads = p.payloads;
      chunk.num_payloads = p.num_payloads;
      chunk.scales_offset = math::kHeaderBytes + 4 * static_cast<uint64_t>(start / p.block_size);
      chunk.codes_offset = codes_at + static_cast<uint64_t>(start / 2);
      chunk.divisor = p.divisor;
      chunk.sum = output.fp32_run(p.begin + start, n);
      if (chunk.sum == nullptr) {
        sum_f32.resize(chunk_size);
        chunk.sum = sum_f32.data();
      }
      chunk.n = n;
      chunk.block = static_cast<int>(p.block_size);
      if (detail::q4_decode_chunk(chunk, isa)) nonfinite = true;
      if (chunk.sum == sum_f32.data()) output.scatter(p.begin + start, n, chunk.sum);
    }
  }
  if (p.nonfinite != nullptr && nonfinite) *p.nonfinite = 1;
}

uint64_t topk_encode(const TopKEncodeParams& p) {
  check_dtype(p.dtype, "top-k encode");
  check_dtype(p.residual_dtype, "top-k encode residual");
  check_dtype(p.value_dtype, "top-k encode values");
  check_segments(p.segments, p.num_segments, p.begin, p.numel, "top-k encode");
  GRADCOMP_CHECK(p.numel <= kTopKMaxNumel,
                 "top-k encode: bucket of "
                     << p.numel << " elements is too large (limit 2^31 - 1: indices are 32-bit)");
  GRADCOMP_CHECK(p.k >= 0 && p.k <= p.numel,
                 "top-k encode: k = " << p.k << " outside [0, " << p.numel << "]");
  GRADCOMP_CHECK(
      p.capacity <= static_cast<uint64_t>(p.numel) && (!p.exact || p.capacity == p.k),
      "top-k encode: capacity " << p.capacity << " must be <= numel and equal k in exact mode");
  GRADCOMP_CHECK(p.payload != nullptr, "top-k encode: payload is null");
  const int64_t n = p.numel;
  std::unique_ptr<float[]> own;
  float* acc = static_cast<float*>(p.workspace);
  if (acc == nullptr) {
    own.reset(new float[static_cast<size_t>(n)]);
    acc = own.get();
  }
  load_sums(SegmentView(p.segments, p.num_segments, p.dtype), p.begin, p.residual_in,
            p.residual_dtype, n, acc);

  uint32_t threshold = 0;
  uint64_t eq_limit = ~uint64_t{0};
  if (p.exact) {
    topk_exact_threshold(acc, n, p.k, &threshold, &eq_limit);
  } else if (n > 0) {
    threshold = topk_sample_threshold(acc, n, p.k);
  }

  const PayloadHeader h0 = math::make_topk_header(n, p.capacity, 0, p.dtype, p.value_dtype);
  uint32_t* indices = reinterpret_cast<uint32_t*>(p.payload + math::kHeaderBytes);
  uint8_t* values = p.payload + math::section1_offset(h0);
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
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = math::topk_key(acc[i]);
    if (key < visit_from) continue;
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
  }
  if (p.residual_out != nullptr) {
    store_floats(p.residual_out, 0, n, p.residual_dtype, acc);
    for (const ResidualFix& f : fixes)
      math::store_from_float(p.residual_out, f.index, p.residual_dtype, f.residual);
  }
  write_header(p.payload, math::make_topk_header(n, p.capacity, written, p.dtype, p.value_dtype));
  return written;
}

void topk_decode(const TopKDecodeParams& p) {
  check_dtype(p.dtype, "top-k decode");
  check_segments(p.segments, p.num_segments, p.begin, p.numel, "top-k decode");
  GRADCOMP_CHECK(p.numel <= kTopKMaxNumel,
                 "top-k decode: bucket of " << p.numel << " elements is too large");
  validate_payloads(p.payloads, p.num_payloads, p.payload_bytes, math::kCodecTopK, p.numel,
                    p.capacity, p.value_dtype, "top-k decode");
  for (int w = 0; w < p.num_payloads; ++w) {
    const PayloadHeader h = read_header(p.payloads[w]);
    const uint32_t* idx = reinterpret_cast<const uint32_t*>(p.payloads[w] + math::kHeaderBytes);
    for (uint64_t e = 0; e < h.count; ++e) {
      GRADCOMP_CHECK(idx[e] < static_cast<uint64_t>(p.numel),
                     "top-k decode: payload " << w << " entry " << e << " has index " << idx[e]
                                              << " outside [0, " << p.numel << ")");
      GRADCOMP_CHECK(e == 0 || idx[e] > idx[e - 1],
                     "top-k decode: payload " << w << " entry " << e
                                              << " breaks the strictly increasing index order");
    }
  }
  std::unique_ptr<float[]> own;
  float* sum = static_cast<float*>(p.workspace);
  if (sum == nullptr) {
    own.reset(new float[static_cast<size_t>(p.numel)]);
    sum = own.get();
  }
  std::fill(sum, sum + p.numel, 0.0f);
  for (int w = 0; w < p.num_payloads; ++w) {
    const PayloadHeader h = read_header(p.payloads[w]);
    const uint32_t* idx = reinterpret_cast<const uint32_t*>(p.payloads[w] + math::kHeaderBytes);
    const uint8_t* values = p.payloads[w] + math::section1_offset(h);
    for (uint64_t e = 0; e < h.count; ++e) {
      sum[idx[e]] = math::add_rn(
          sum[idx[e]], math::load_as_float(values, static_cast<int64_t>(e), p.value_dtype));
    }
  }
  bool nonfinite = false;
  for (int64_t i = 0; i < p.numel; ++i) {
    sum[i] = math::div_rn(sum[i], p.divisor);
    nonfinite |= !math::is_finite_bits(math::float_bits(sum[i]));
  }
  SegmentView(p.segments, p.num_segments, p.dtype).scatter(p.begin, p.numel, sum);
  if (p.nonfinite != nullptr && nonfinite) *p.nonfinite = 1;
}

}  // namespace cpu
}  // namespace gradcomp
