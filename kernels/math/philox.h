// Philox4x32-10 (Salmon et al., SC'11) and the one key schedule every backend draws random bits by.
#pragma once

#include "float_ops.h"

namespace gradcomp {
namespace math {

struct Philox4 {
  uint32_t v[4];
};

GRADCOMP_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t p = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(p >> 32);
  *lo = (uint32_t)p;
}

constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;

GRADCOMP_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                  uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kPhiloxMul0, c0, &hi0, &lo0);
    mulhilo32(kPhiloxMul1, c2, &hi1, &lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kPhiloxWeyl0;
    k1 += kPhiloxWeyl1;
  }
  Philox4 r;
  r.v[0] = c0;
  r.v[1] = c1;
  r.v[2] = c2;
  r.v[3] = c3;
  return r;
}

// Where a random stream comes from. Two encodes with equal keys draw equal bits.
struct RngKey {
  uint64_t seed;
  uint32_t step;
  uint32_t bucket;
  uint32_t rank;
  uint32_t phase;  // distinguishes encodes of the same elements within one step (two-phase q4)
};

// Sixteen random bits per element; one Philox call serves the 8 elements of one aligned group.
constexpr int kRandomGroup = 8;

// The Philox key of a random stream; the counter is (group, step, bucket).
GRADCOMP_HD uint32_t philox_key0(const RngKey& key) {
  return (uint32_t)key.seed ^ (key.rank * 0x9E3779B9u);
}
GRADCOMP_HD uint32_t philox_key1(const RngKey& key) {
  return (uint32_t)(key.seed >> 32) ^ (key.phase * 0xBB67AE85u);
}

// The random words of element group `group` (elements 8 * group to 8 * group + 7).
GRADCOMP_HD Philox4 random_group(const RngKey& key, uint64_t group) {
  return philox4x32_10((uint32_t)group, (uint32_t)(group >> 32), key.step, key.bucket,
                       philox_key0(key), philox_key1(key));
}

GRADCOMP_HD uint32_t random16(const Philox4& r, int lane) {
  uint32_t w = r.v[lane >> 1];
  return (lane & 1) ? (w >> 16) : (w & 0xFFFFu);
}

}  // namespace math
}  // namespace gradcomp
