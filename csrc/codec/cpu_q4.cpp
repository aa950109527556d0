// CPU q4 codec: chunked encode (with error feedback) and decode-sum over W payloads.
#include <algorithm>
#include <vector>

#include "cpu_codec_util.h"
#include "cpu_q4_loops.h"
#include "gradcomp/cpu.h"
#include "params_checks.h"

namespace gradcomp {
namespace cpu {

using format::PayloadHeader;

void q4_encode(const Q4EncodeParams& p, int num_threads) {
  ::gradcomp::detail::check_params(p, "q4 encode");
  GRADCOMP_CHECK(p.codec == format::kCodecQ4, "q4 encode: params are for codec " << int(p.codec));
  const PayloadHeader h = format::make_q4_header(p.numel, p.block_size, p.dtype, p.stochastic);
  format::write_header(p.payload, h);
  float* scales = reinterpret_cast<float*>(p.payload + kPayloadHeaderBytes);
  uint8_t* codes = p.payload + format::section1_offset(h);
  const int64_t chunk_size = detail::kQ4ChunkElements;
  const int64_t nchunks = (p.numel + chunk_size - 1) / chunk_size;
  const bool f32_residual = p.residual_dtype == math::kDtypeF32;
  const int input_stride = static_cast<int>(math::dtype_bytes(p.dtype));
  const int residual_stride = static_cast<int>(math::dtype_bytes(p.residual_dtype));
  const Isa isa = active_isa();
  detail::SegmentView input(p.segments, p.num_segments, p.dtype);

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
        detail::load_floats(p.residual_in, start, n, p.residual_dtype, residual_in_f32.data());
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
        detail::store_floats(p.residual_out, start, n, p.residual_dtype, chunk.residual_out);
    }
  }
  format::seal_payload(p.payload, h);
}

void q4_decode(const Q4DecodeParams& p, int num_threads) {
  ::gradcomp::detail::check_params(p, "q4 decode");
  GRADCOMP_CHECK(p.codec == format::kCodecQ4, "q4 decode: params are for codec " << int(p.codec));
  detail::validate_payloads(
      p.payloads, p.num_payloads, p.payload_bytes, format::kCodecQ4, [&](int) { return p.numel; },
      p.block_size, math::kDtypeF32, "q4 decode");
  const uint64_t codes_at = format::section1_offset(format::read_header(p.payloads[0]));
  const int64_t chunk_size = detail::kQ4ChunkElements;
  const int64_t nchunks = (p.numel + chunk_size - 1) / chunk_size;
  const Isa isa = active_isa();
  detail::SegmentView output(p.segments, p.num_segments, p.dtype);
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
      chunk.scales_offset = kPayloadHeaderBytes + 4 * static_cast<uint64_t>(start / p.block_size);
      chunk.codes_offset = codes_at + static_cast<uint64_t>(start / 2);
      chunk.divisor = p.divisor;
      chunk.sum = output.fp32_run(p.begin + start, n);
      if (chunk.sum == nullptr) {
        sum_f32.resize(chunk_size);
        chunk.sum = sum_f32.data();
      }
      chunk.n = n;
      chunk.block = static_cast<int>(p.block_size);
      if (detail::q4_decode_chunk(chunk, isa)) {
        nonfinite = true;
        // The vector loops pass on x86's NaNs: every NaN written is the canonical one, as the
        // element math's (and CUDA's) arithmetic gives.
        for (int i = 0; i < n; ++i) chunk.sum[i] = math::canonical_nan_if_nan(chunk.sum[i]);
      }
      if (chunk.sum == sum_f32.data()) output.scatter(p.begin + start, n, chunk.sum);
    }
  }
  if (p.nonfinite != nullptr && nonfinite) *p.nonfinite = 1;
}

void check_payloads(const PayloadCheckParams& p) {
  ::gradcomp::detail::check_params(p, "payload check");
  detail::validate_payloads(
      p.payloads, p.num_payloads, p.payload_bytes, p.codec, [&](int w) { return p.numel[w]; },
      p.param, p.value_dtype, "payload check");
}

}  // namespace cpu
}  // namespace gradcomp
