// Float operations in IEEE round-to-nearest that neither compiler may contract, and bit views.
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define GRADCOMP_HD __host__ __device__ __forceinline__
#else
#define GRADCOMP_HD inline
#endif

namespace gradcomp {
namespace math {

GRADCOMP_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  union {
    float f;
    uint32_t u;
  } v;
  v.f = f;
  return v.u;
#endif
}
GRADCOMP_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  union {
    float f;
    uint32_t u;
  } v;
  v.u = u;
  return v.f;
#endif
}

// The NaN every operation below returns for a NaN result: CUDA's float arithmetic returns this
// one whatever the operands, while x86 passes on an operand's NaN or its own default NaN, so the
// host replaces those and both backends write the same bytes.
constexpr uint32_t kCanonicalNanBits = 0x7FFFFFFFu;

GRADCOMP_HD float canonical_nan_if_nan(float r) {
#if defined(__CUDA_ARCH__)
  return r;
#else
  return r != r ? bits_float(kCanonicalNanBits) : r;
#endif
}

// Every float operation of the element math goes through these helpers so that neither nvcc nor
// the host compiler can contract a multiply and an add into an FMA: contraction would change the
// bytes.
GRADCOMP_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return canonical_nan_if_nan(a + b);
#endif
}
GRADCOMP_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return canonical_nan_if_nan(a - b);
#endif
}
GRADCOMP_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return canonical_nan_if_nan(a * b);
#endif
}
GRADCOMP_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return canonical_nan_if_nan(a / b);
#endif
}
// a * b + c rounded once (IEEE fusedMultiplyAdd): the v2 encoder's exact remainder.
GRADCOMP_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return canonical_nan_if_nan(fmaf(a, b, c));
#endif
}
GRADCOMP_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return canonical_nan_if_nan(sqrtf(a));  // IEEE 754 requires sqrt correctly rounded
#endif
}

GRADCOMP_HD bool is_finite_bits(uint32_t bits) {
  return (bits & 0x7F800000u) != 0x7F800000u;
}

// |x| as bits: as integers these order finite values by magnitude, then Inf, then NaN.
GRADCOMP_HD uint32_t abs_bits(float x) {
  return float_bits(x) & 0x7FFFFFFFu;
}

// The decoders' mean: when the divisor is +-2^e with e in [-126, 126], its reciprocal
// +-2^-e is an exact normal float and x * 2^-e is the same correctly rounded value as x / 2^e for
// every x (zeros, subnormal results, infinities and NaN included), so the device may multiply.
// Returns false (and leaves *inv) for any other divisor.
GRADCOMP_HD bool pow2_reciprocal(float divisor, float* inv) {
  const uint32_t b = float_bits(divisor);
  const uint32_t exp = (b >> 23) & 0xFFu;
  if ((b & 0x007FFFFFu) != 0 || exp < 1 || exp > 253)
    return false;  // not +-2^e, or 2^-e
                   // not normal
  *inv = bits_float((b & 0x80000000u) | ((254u - exp) << 23));
  return true;
}

}  // namespace math
}  // namespace gradcomp
