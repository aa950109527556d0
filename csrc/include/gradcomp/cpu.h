// CPU backend: the reference implementation of every codec. Payloads equal the CUDA backend's.
#pragma once

#include <cstdint>

#include "gradcomp/types.h"

namespace gradcomp {
namespace cpu {

// Encodes one q4 payload. Throws Error on bad parameters. num_threads splits blocks over threads.
void q4_encode(const Q4EncodeParams& params, int num_threads = 1);

// Validates every payload header first; on any mismatch throws Error and writes nothing.
void q4_decode(const Q4DecodeParams& params, int num_threads = 1);

// Encodes one top-k payload; returns the entries written.
uint64_t topk_encode(const TopKEncodeParams& params);

// Validates every header and every index (in range, strictly increasing) before writing.
void topk_decode(const TopKDecodeParams& params);

}  // namespace cpu
}  // namespace gradcomp
