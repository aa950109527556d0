// Inner loops of the CPU q4 codec over fp32 chunks: portable, AVX2 and AVX-512, equal bytes.
#pragma once

#include <cstdint>

#include "gradcomp/cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#define GRADCOMP_X86 1
#endif

namespace gradcomp {
namespace cpu {
namespace detail {

// Chunks are whole blocks of every allowed block size, small enough that a chunk's working set
// (values, random bits) stays in L1/L2 between the passes over it.
constexpr int64_t kQ4ChunkElements = 4096;

// One chunk of a q4 encode, with input and residuals already converted to fp32.
struct Q4EncodeChunk {
  const float* input = nullptr;        // n values
  const float* residual_in = nullptr;  // n values, or null for zeros; may alias residual_out
  // The next chunk's raw input and residual bytes (any dtype, `*_stride` bytes per element),
  // prefetched while this chunk computes; null when unknown.
  const void* next_input = nullptr;
  const void* next_residual_in = nullptr;
  int next_input_stride = 4;
  int next_residual_stride = 4;
  float* residual_out = nullptr;  // n values, or null without error feedback
  float* scales = nullptr;        // one per block of the chunk
  uint8_t* codes = nullptr;       // (n + 1) / 2 bytes, the chunk's first element in byte 0
  int64_t first_element = 0;      // element index of input[0] for the random stream
  int n = 0;                      // at most kQ4ChunkElements; a multiple of block except last
  int block = 64;
  bool stochastic = true;
  math::RngKey rng = {0, 0, 0, 0, 0};
};

// One chunk of a q4 decode: sum[i] = (sum over payloads of dequantized element i) / divisor.
struct Q4DecodeChunk {
  const uint8_t* const* payloads = nullptr;
  int num_payloads = 0;
  uint64_t scales_offset = 0;  // byte offset of the chunk's first scale in every payload
  uint64_t codes_offset = 0;   // byte offset of the chunk's first code byte
  float divisor = 1.0f;
  float* sum = nullptr;  // n outputs
  int n = 0;
  int block = 64;
};

// The loops of `isa` (cpu_isa.cpp dispatches).
void q4_encode_chunk(const Q4EncodeChunk& chunk, Isa isa);
// Returns true when any output is non-finite.
bool q4_decode_chunk(const Q4DecodeChunk& chunk, Isa isa);

// The portable loops (cpu_q4_portable.cpp); the vector loops use them for tails.
void random_bits_portable(const math::RngKey& key, int64_t first_element, int n, uint16_t* r16);
// Encodes elements [s, s + n) of the chunk, one block; r16 holds the chunk's random bits (null
// for round-to-nearest).
void encode_block_portable(const Q4EncodeChunk& c, int s, int n, const uint16_t* r16);
void encode_chunk_portable(const Q4EncodeChunk& c);
bool decode_chunk_portable(const Q4DecodeChunk& c);

#if GRADCOMP_X86
// AVX2 loops, with AVX-512 random bits and quantization when `wide` (cpu_q4_x86.cpp).
void encode_chunk_x86(const Q4EncodeChunk& c, bool wide);
bool decode_chunk_x86(const Q4DecodeChunk& c);
#endif

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
