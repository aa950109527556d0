// What differs between the v2 block codecs on the device: q4 (fp32 steps, 4-bit codes) and q2
// (bf16 steps, 2-bit codes). The element rules are q4_math.h's and q2_math.h's conversion-free
// ones.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

// q4: a lane's 8 codes fill one 32-bit word, its block's step is an fp32 word.
struct Q4Codes {
  static constexpr uint8_t kCodec = format::kCodecQ4;
  static constexpr uint8_t kScaleDtype = math::kDtypeF32;
  static constexpr int kCodeBits = 4;
  static constexpr int kLog2CodesPerByte = 1;
  static constexpr int kScaleBytes = 4;
  __device__ __forceinline__ static float step_of_absmax(uint32_t absmax_bits) {
    return math::q4_step_from_absmax_bits(absmax_bits);
  }
  __device__ __forceinline__ static float code_of_quotient(float t0, float step, uint32_t r16,
                                                           bool sr) {
    return math::q4_quantize_quotient(t0, step, r16, sr);
  }
  __device__ __forceinline__ static float code_of(float x, float step, uint32_t r16, bool sr) {
    return math::q4_quantize_float(x, step, r16, sr);
  }
  __device__ __forceinline__ static uint32_t bits_of(float code) {
    return math::q4_nibble_of(code);
  }
  // The code's level in steps (the residual is x - level * step).
  __device__ __forceinline__ static float level_of(float code) { return code; }
  __device__ __forceinline__ static float level_of_bits(uint32_t bits) {
    return math::q4_code_value(bits & 0xFu);
  }
  // A short lane's codes past its end: the zero code's nibble, as the CPU pads.
  __device__ __forceinline__ static uint32_t pad(uint32_t packed, int) { return packed; }
  __device__ __forceinline__ static void store_codes(uint8_t* at, uint32_t packed) {
    __stcs(reinterpret_cast<unsigned int*>(at), packed);
  }
  __device__ __forceinline__ static uint32_t load_codes(const uint8_t* at) {
    return __ldg(reinterpret_cast<const unsigned int*>(at));
  }
  // Writes the step as the payload holds it and returns those bits (for the checksum).
  __device__ __forceinline__ static uint32_t store_scale(uint8_t* at, float step) {
    *reinterpret_cast<float*>(at) = step;
    return __float_as_uint(step);
  }
  __device__ __forceinline__ static float load_step(const uint8_t* scales, uint64_t block) {
    return __ldg(reinterpret_cast<const float*>(scales) + block);
  }
};

// q2: a lane's 8 codes fill one 16-bit half-word, its block's step is a bf16 value.
struct Q2Codes {
  static constexpr uint8_t kCodec = format::kCodecQ2;
  static constexpr uint8_t kScaleDtype = math::kDtypeBF16;
  static constexpr int kCodeBits = 2;
  static constexpr int kLog2CodesPerByte = 2;
  static constexpr int kScaleBytes = 2;
  __device__ __forceinline__ static float step_of_absmax(uint32_t absmax_bits) {
    return math::q2_step_from_absmax_bits(absmax_bits);
  }
  __device__ __forceinline__ static float code_of_quotient(float t0, float step, uint32_t r16,
                                                           bool sr) {
    return math::q2_quantize_quotient(t0, step, r16, sr);
  }
  __device__ __forceinline__ static float code_of(float x, float step, uint32_t r16, bool sr) {
    return math::q2_quantize_float(x, step, r16, sr);
  }
  __device__ __forceinline__ static uint32_t bits_of(float code) {
    return math::q2_code_bits_of(code);
  }
  __device__ __forceinline__ static float level_of(float code) { return math::q2_level_of(code); }
  __device__ __forceinline__ static float level_of_bits(uint32_t bits) {
    return math::q2_code_value_of_bits(bits & 3u);
  }
  // A short lane's codes past its end are zero bits, as the CPU pads its last byte.
  __device__ __forceinline__ static uint32_t pad(uint32_t packed, int n) {
    return n >= 8 ? packed : packed & ((1u << (kCodeBits * n)) - 1u);
  }
  __device__ __forceinline__ static void store_codes(uint8_t* at, uint32_t packed) {
    __stcs(reinterpret_cast<unsigned short*>(at), static_cast<unsigned short>(packed));
  }
  __device__ __forceinline__ static uint32_t load_codes(const uint8_t* at) {
    return __ldg(reinterpret_cast<const unsigned short*>(at));
  }
  __device__ __forceinline__ static uint32_t store_scale(uint8_t* at, float step) {
    const uint16_t bits = math::q2_scale_bits(step);
    *reinterpret_cast<uint16_t*>(at) = bits;
    return bits;
  }
  __device__ __forceinline__ static float load_step(const uint8_t* scales, uint64_t block) {
    return math::q2_step_of_scale(__ldg(reinterpret_cast<const unsigned short*>(scales) + block));
  }
};

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
