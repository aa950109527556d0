// Wire format v1: payload sizes, header parsing and validation (docs/format.md).
#pragma once

#include <cstdint>
#include <string>

#include "gradcomp/types.h"
#include "payload_header.h"

namespace gradcomp {

// Bytes of a q4 payload holding numel elements in blocks of block_size.
uint64_t q4_payload_bytes(int64_t numel, int block_size);
// Bytes of a q2 payload holding numel elements in blocks of block_size.
uint64_t q2_payload_bytes(int64_t numel, int block_size);
// Bytes of a top-k payload with room for `capacity` entries.
uint64_t topk_payload_bytes(int64_t capacity, DType value_dtype);

// Decoded header fields, for tools and tests.
struct PayloadInfo {
  Codec codec;
  DType dtype;
  DType value_dtype;
  bool stochastic;
  int64_t numel;
  uint32_t param;  // q4, q2: block size; top-k: capacity
  uint64_t count;  // q4, q2: blocks; top-k: entries present
  uint64_t section0_bytes;
  uint64_t section1_bytes;
  uint64_t total_bytes;
};

// Reads and checks the header (magic, version, checksum, sizes against `size`); throws Error.
// Only the header is read: the body checksum is checked by the decoders, which read the body.
PayloadInfo inspect_payload(const uint8_t* payload, uint64_t size);

// Text for a format::PayloadStatus code.
const char* payload_status_message(int status);

}  // namespace gradcomp
