// The small mixed-dtype row whose payload both weight codecs' tests spell out byte for byte.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "math/half.h"

namespace gradcomp {

// An fp32 run of 20 (a whole block of 16 and a short one of zeros) and a bf16 run of 3, as bytes.
// Values at multiples of `s` (the first block's scale in the codec under test) are its codes'
// ties and their neighbours.
inline std::vector<uint8_t> small_weight_row_bytes(float s) {
  const float f[20] = {1.0f,  -0.5f, 0.25f, 2.5f * s, -2.5f * s, 0.5f * s, 3.5f * s,
                       0.0f,  -1.0f, 0.75f, 1e-3f,    -1e-3f,    0.125f,   1.5f * s,
                       -0.0f, 0.3f,  0.0f,  0.0f,     0.0f,      0.0f};
  const uint16_t b[3] = {0x4040, 0xBFC0, 0x3C00};  // 3.0, -1.5, 2^-7
  std::vector<uint8_t> bytes(sizeof f + sizeof b);
  std::memcpy(bytes.data(), f, sizeof f);
  std::memcpy(bytes.data() + sizeof f, b, sizeof b);
  return bytes;
}

// A decoded small row, split back into its runs.
struct SmallWeightRowValues {
  float f[20];
  uint16_t b[3];
  explicit SmallWeightRowValues(const std::vector<uint8_t>& row) {
    std::memcpy(f, row.data(), sizeof f);
    std::memcpy(b, row.data() + sizeof f, sizeof b);
  }
};

}  // namespace gradcomp
