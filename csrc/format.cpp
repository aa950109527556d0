// Wire format v1: sizes and header inspection on the host.
#include "gradcomp/format.h"

#include <cstring>

#include "element_math.h"

namespace gradcomp {

uint64_t q4_payload_bytes(int64_t numel, int block_size) {
  GRADCOMP_CHECK(numel >= 0, "q4 element count must be >= 0, got " << numel);
  Q4Options{block_size}.validate();
  return math::payload_bytes_of(math::make_q4_header(static_cast<uint64_t>(numel),
                                                     static_cast<uint32_t>(block_size), 0, true));
}

uint64_t topk_payload_bytes(int64_t capacity, DType value_dtype) {
  GRADCOMP_CHECK(capacity >= 0 && capacity <= kTopKMaxNumel,
                 "top-k capacity must be in [0, 2^31), got " << capacity);
  return math::payload_bytes_of(math::make_topk_header(static_cast<uint64_t>(capacity),
                                                       static_cast<uint32_t>(capacity), 0, 0,
                                                       static_cast<uint8_t>(value_dtype)));
}

const char* header_status_message(int status) {
  switch (status) {
    case math::kHeaderOk:
      return "ok";
    case math::kHeaderBadMagic:
      return "bad magic (not a gradcomp payload)";
    case math::kHeaderBadVersion:
      return "unsupported format version";
    case math::kHeaderBadChecksum:
      return "header checksum mismatch (corrupted header)";
    case math::kHeaderBadCodec:
      return "codec differs from the expected codec";
    case math::kHeaderBadDtype:
      return "invalid or unexpected dtype";
    case math::kHeaderLayoutMismatch:
      return "element count, block size, capacity or section sizes differ from the expected layout";
    case math::kHeaderBadCount:
      return "entry count out of range";
    case math::kHeaderTruncated:
      return "payload shorter than its header says";
  }
  return "unknown header status";
}

PayloadInfo inspect_payload(const uint8_t* payload, uint64_t size) {
  GRADCOMP_CHECK(payload != nullptr || size == 0, "payload pointer is null");
  GRADCOMP_CHECK(size >= kPayloadHeaderBytes,
                 "payload of " << size << " bytes is shorter than the 64-byte header");
  math::PayloadHeader h;
  std::memcpy(&h, payload, sizeof h);
  GRADCOMP_CHECK(h.magic == math::kPayloadMagic,
                 "payload: " << header_status_message(math::kHeaderBadMagic));
  GRADCOMP_CHECK(h.version == math::kFormatVersion,
                 "payload: version " << h.version << " is not supported (expected 1)");
  GRADCOMP_CHECK(h.checksum == math::header_checksum(h),
                 "payload: " << header_status_message(math::kHeaderBadChecksum));
  GRADCOMP_CHECK(h.codec == math::kCodecQ4 || h.codec == math::kCodecTopK,
                 "payload: unknown codec " << int(h.codec));
  GRADCOMP_CHECK(h.dtype <= math::kDtypeBF16 && h.value_dtype <= math::kDtypeBF16,
                 "payload: " << header_status_message(math::kHeaderBadDtype));
  if (h.codec == math::kCodecQ4) {
    GRADCOMP_CHECK(h.param >= 16 && h.param <= 256 && (h.param & (h.param - 1)) == 0,
                   "payload: q4 block size " << h.param << " is invalid");
    GRADCOMP_CHECK(h.numel < (uint64_t{1} << 62),
                   "payload: element count " << h.numel << " is invalid");
  } else {
    GRADCOMP_CHECK(h.numel <= static_cast<uint64_t>(kTopKMaxNumel),
                   "payload: top-k element count " << h.numel << " is invalid");
  }
  int status = math::check_header(h, h.codec, h.numel, h.param, h.value_dtype, size);
  GRADCOMP_CHECK(status == math::kHeaderOk, "payload: " << header_status_message(status));
  PayloadInfo info;
  info.codec = static_cast<Codec>(h.codec);
  info.dtype = static_cast<DType>(h.dtype);
  info.value_dtype = static_cast<DType>(h.value_dtype);
  info.stochastic = (h.flags & 1) != 0;
  info.numel = static_cast<int64_t>(h.numel);
  info.param = h.param;
  info.count = h.count;
  info.section0_bytes = h.section0_bytes;
  info.section1_bytes = h.section1_bytes;
  info.total_bytes = math::payload_bytes_of(h);
  return info;
}

}  // namespace gradcomp
