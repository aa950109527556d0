// CPU q2 codec: chunked encode (with error feedback) and decode-sum over W payloads, portable.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_codec_util.h"
#include "cpu_q4_loops.h"
#include "gradcomp/cpu.h"
#include "params_checks.h"

namespace gradcomp {
namespace cpu {
namespace {

using format::PayloadHeader;

// Chunks of whole blocks and whole code bytes (every block size is a multiple of 4), sized as
// q4's so the random bits of a chunk stay in L1.
constexpr int64_t kChunk = detail::kQ4ChunkElements;

struct EncodeChunk {
  const float* input;
  const float* residual_in;  // null: zeros
  float* residual_out;       // null: no error feedback
  uint8_t* scales;           // the chunk's first block's scale
  uint8_t* codes;            // the chunk's first code byte
  int n;
  int block;
  bool stochastic;
  const uint16_t* r16;  // n random words, or null for round-to-nearest
};

void encode_block(const EncodeChunk& c, int s, int n) {
  float acc[math::kQ2MaxBlock], rin[math::kQ2MaxBlock];
  uint32_t q[math::kQ2MaxBlock];
  uint32_t absmax = 0;
  for (int i = 0; i < n; ++i) {
    rin[i] = c.residual_in != nullptr ? c.residual_in[s + i] : 0.0f;
    acc[i] = math::add_rn(c.input[s + i], rin[i]);
    absmax = std::max(absmax, math::abs_bits(acc[i]));
  }
  const float step = math::q2_step_from_absmax_bits(absmax);
  const uint16_t scale = math::q2_scale_bits(step);
  std::memcpy(c.scales + 2 * (s / c.block), &scale, 2);
  for (int i = 0; i < n; ++i)
    q[i] = math::q2_quantize(acc[i], step, c.r16 != nullptr ? c.r16[s + i] : 0u, c.stochastic);
  // A short last block pads its last byte with zero bits, which no decode reads.
  for (int i = 0; i < n; i += 4) {
    uint32_t byte = 0;
    for (int k = 0; k < 4 && i + k < n; ++k) byte |= q[i + k] << (2 * k);
    c.codes[(s + i) / 4] = static_cast<uint8_t>(byte);
  }
  if (c.residual_out == nullptr) return;
  // A non-finite block keeps its old residual so one bad step cannot poison later ones.
  const bool finite = math::is_finite_bits(absmax);
  for (int i = 0; i < n; ++i)
    c.residual_out[s + i] = finite ? math::sub_rn(acc[i], math::q2_dequantize(q[i], step)) : rin[i];
}

// Returns true when any output is non-finite.
bool decode_chunk(const uint8_t* const* payloads, int num_payloads, uint64_t scales_offset,
                  uint64_t codes_offset, float divisor, float* sum, int n, int block) {
  for (int w = 0; w < num_payloads; ++w) {
    const uint8_t* scales = payloads[w] + scales_offset;
    const uint8_t* codes = payloads[w] + codes_offset;
    for (int s = 0; s < n; s += block) {
      uint16_t scale;
      std::memcpy(&scale, scales + 2 * (s / block), 2);
      const float step = math::q2_step_of_scale(scale);
      const int end = std::min(n, s + block);
      for (int i = s; i < end; ++i) {
        const float v =
            math::q2_dequantize(math::q2_code_at(codes, static_cast<uint64_t>(i)), step);
        sum[i] = math::add_rn(w == 0 ? 0.0f : sum[i], v);
      }
    }
  }
  bool nonfinite = false;
  for (int i = 0; i < n; ++i) {
    sum[i] = math::div_rn(sum[i], divisor);
    nonfinite |= !math::is_finite_bits(math::float_bits(sum[i]));
  }
  return nonfinite;
}

}  // namespace

void q2_encode(const Q4EncodeParams& p, int num_threads) {
  ::gradcomp::detail::check_params(p, "q2 encode");
  GRADCOMP_CHECK(p.codec == format::kCodecQ2, "q2 encode: params are for codec " << int(p.codec));
  const PayloadHeader h = format::make_q2_header(p.numel, p.block_size, p.dtype, p.stochastic);
  format::write_header(p.payload, h);
  uint8_t* scales = p.payload + kPayloadHeaderBytes;
  uint8_t* codes = p.payload + format::section1_offset(h);
  const int64_t nchunks = (p.numel + kChunk - 1) / kChunk;
  detail::SegmentView input(p.segments, p.num_segments, p.dtype);

#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
  {
    std::vector<float> input_f32(kChunk), residual_in_f32, residual_out_f32;
    std::vector<uint16_t> random_bits(kChunk);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t start = c * kChunk;
      const int n = static_cast<int>(std::min(kChunk, p.numel - start));
      input.gather(p.begin + start, n, input_f32.data());
      EncodeChunk chunk{input_f32.data(),
                        nullptr,
                        nullptr,
                        scales + 2 * (start / p.block_size),
                        codes + start / 4,
                        n,
                        static_cast<int>(p.block_size),
                        p.stochastic,
                        nullptr};
      if (p.residual_in != nullptr) {
        residual_in_f32.resize(kChunk);
        detail::load_floats(p.residual_in, start, n, p.residual_dtype, residual_in_f32.data());
        chunk.residual_in = residual_in_f32.data();
      }
      if (p.residual_out != nullptr) {
        residual_out_f32.resize(kChunk);
        chunk.residual_out = residual_out_f32.data();
      }
      // The random stream is q4's: 16 bits per element, keyed by its index in the bucket.
      if (p.stochastic) {
        detail::random_bits_portable(p.rng, p.begin + start, n, random_bits.data());
        chunk.r16 = random_bits.data();
      }
      for (int s = 0; s < n; s += chunk.block) encode_block(chunk, s, std::min(chunk.block, n - s));
      if (p.residual_out != nullptr)
        detail::store_floats(p.residual_out, start, n, p.residual_dtype, chunk.residual_out);
    }
  }
  format::seal_payload(p.payload, h);
}

void q2_decode(const Q4DecodeParams& p, int num_threads) {
  ::gradcomp::detail::check_params(p, "q2 decode");
  GRADCOMP_CHECK(p.codec == format::kCodecQ2, "q2 decode: params are for codec " << int(p.codec));
  detail::validate_payloads(
      p.payloads, p.num_payloads, p.payload_bytes, format::kCodecQ2, [&](int) { return p.numel; },
      p.block_size, math::kDtypeBF16, "q2 decode");
  const uint64_t codes_at = format::section1_offset(format::read_header(p.payloads[0]));
  const int64_t nchunks = (p.numel + kChunk - 1) / kChunk;
  detail::SegmentView output(p.segments, p.num_segments, p.dtype);
  bool nonfinite = false;

#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(|| : nonfinite)
  {
    std::vector<float> sum_f32(kChunk);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t start = c * kChunk;
      const int n = static_cast<int>(std::min(kChunk, p.numel - start));
      if (decode_chunk(p.payloads, p.num_payloads,
                       kPayloadHeaderBytes + 2 * static_cast<uint64_t>(start / p.block_size),
                       codes_at + static_cast<uint64_t>(start / 4), p.divisor, sum_f32.data(), n,
                       static_cast<int>(p.block_size)))
        nonfinite = true;
      output.scatter(p.begin + start, n, sum_f32.data());
    }
  }
  if (p.nonfinite != nullptr && nonfinite) *p.nonfinite = 1;
}

}  // namespace cpu
}  // namespace gradcomp
