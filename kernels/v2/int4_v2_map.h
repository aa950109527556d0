// The 4-bit weight v2 kernels' index map and code packing: int8's chunk map (16 elements a lane),
// whose chunk is 8 code bytes here, and the byte map of runs at any row offset. Host and device
// share it, so host tests replay the kernels against the CPU reference (test_int4_v2_map.cpp).
#pragma once

#include "math/int4_math.h"
#include "v2/int8_v2_map.h"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace int4 {

using int8::blocks_per_warp;
using int8::ChunkMap;
using int8::kChunk;  // 16 elements: 8 code bytes, one 8-byte access

// Whether a run takes the fused aligned kernel: its elements 16-byte aligned and its codes 8-byte
// aligned, i.e. its row offset a multiple of 16 elements (codes section and payloads are 16-byte
// aligned). Blocks start at multiples of 16 elements, so then no code byte holds two blocks.
GRADCOMP_HD bool run_aligned(uintptr_t elements, uint64_t row_offset) {
  return (elements & 15) == 0 && row_offset % 16 == 0;
}

// A block's bf16 scale from the largest |x| bits its lanes found (finite; the kernels refuse a
// non-finite block before): the reference's int4_scale_bits.
GRADCOMP_HD uint16_t block_scale_bits(uint32_t max_abs_bits) {
  return math::int4_scale_bits(math::bits_float(max_abs_bits));
}

// The nibbles of 8 consecutive elements of one block (element j in bits 4j..4j+3), from the
// scale's refined reciprocal y (the block in math::int8_fast_block's domain).
GRADCOMP_HD uint32_t codes_word(const float (&v)[8], float scale, float y) {
  uint32_t word = 0;
  for (int j = 0; j < 8; ++j)
    word |= math::int4_nibble_of_quotient(math::q4_fast_quotient(v[j], scale, y), scale) << (4 * j);
  return word;
}

// A run's code bytes in the codes section: element i of the run is element row_offset + i of
// the row, in nibble (row_offset + i) % 2 of byte (row_offset + i) / 2.
struct RunBytes {
  uint64_t first;  // the byte holding the run's first element
  uint64_t end;    // one past the byte holding its last
  GRADCOMP_HD RunBytes(uint64_t row_offset, uint64_t numel)
      : first(row_offset / 2), end((row_offset + numel + 1) / 2) {}
};

// The run elements byte g holds: lo = 2g - row_offset (low nibble) and lo + 1 (high nibble);
// either may lie outside the run. A low nibble before the run belongs to the previous run, whose
// launch has finished: the byte keeps it. A high nibble past the run is the next run's (whose
// launch will keep this byte's low nibble) or padding: it is written 0.
GRADCOMP_HD int64_t byte_low_element(uint64_t g, uint64_t row_offset) {
  return static_cast<int64_t>(2 * g) - static_cast<int64_t>(row_offset);
}

}  // namespace int4
}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
