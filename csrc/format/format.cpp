// Wire format v1: sizes and header inspection on the host.
#include "gradcomp/format.h"

namespace gradcomp {

uint64_t q4_payload_bytes(int64_t numel, int block_size) {
  GRADCOMP_CHECK(numel >= 0, "q4 element count must be >= 0, got " << numel);
  const char* problem = q4_block_problem(static_cast<uint32_t>(block_size));
  GRADCOMP_CHECK(problem == nullptr, "q4 block size " << block_size << ": " << problem);
  return format::payload_bytes_of(format::make_q4_header(
      static_cast<uint64_t>(numel), static_cast<uint32_t>(block_size), 0, true));
}

uint64_t q2_payload_bytes(int64_t numel, int block_size) {
  GRADCOMP_CHECK(numel >= 0, "q2 element count must be >= 0, got " << numel);
  GRADCOMP_CHECK(
      math::q2_block_size_valid(static_cast<uint32_t>(block_size)),
      "q2 block size " << block_size << ": block size must be a power of two in [16, 256]");
  return format::payload_bytes_of(format::make_q2_header(
      static_cast<uint64_t>(numel), static_cast<uint32_t>(block_size), 0, true));
}

uint64_t topk_payload_bytes(int64_t capacity, DType value_dtype) {
  GRADCOMP_CHECK(capacity >= 0 && capacity <= kTopKMaxNumel,
                 "top-k capacity must be in [0, 2^31), got " << capacity);
  return format::payload_bytes_of(format::make_topk_header(static_cast<uint64_t>(capacity),
                                                           static_cast<uint32_t>(capacity), 0, 0,
                                                           static_cast<uint8_t>(value_dtype)));
}

const char* payload_status_message(int status) {
  switch (status) {
    case format::kPayloadOk:
      return "ok";
    case format::kBadMagic:
      return "bad magic (not a gradcomp payload)";
    case format::kBadVersion:
      return "unsupported format version";
    case format::kBadChecksum:
      return "header checksum mismatch (corrupted header)";
    case format::kBadCodec:
      return "codec differs from the expected codec";
    case format::kBadDtype:
      return "invalid or unexpected dtype";
    case format::kLayoutMismatch:
      return "element count, block size, capacity or section sizes differ from the expected layout";
    case format::kBadCount:
      return "entry count out of range";
    case format::kTruncated:
      return "payload shorter than its header says";
    case format::kBadIndex:
      return "a top-k index is out of range or out of order";
    case format::kBadBodyChecksum:
      return "body checksum mismatch (corrupted sections)";
  }
  return "unknown payload status";
}

PayloadInfo inspect_payload(const uint8_t* payload, uint64_t size) {
  GRADCOMP_CHECK(payload != nullptr || size == 0, "payload pointer is null");
  GRADCOMP_CHECK(size >= kPayloadHeaderBytes,
                 "payload of " << size << " bytes is shorter than the 64-byte header");
  const format::PayloadHeader h = format::read_header(payload);
  GRADCOMP_CHECK(h.magic == format::kPayloadMagic,
                 "payload: " << payload_status_message(format::kBadMagic));
  GRADCOMP_CHECK(h.version == format::kFormatVersion,
                 "payload: version " << h.version << " is not supported (expected "
                                     << format::kFormatVersion << ")");
  GRADCOMP_CHECK(h.checksum == format::header_checksum(h),
                 "payload: " << payload_status_message(format::kBadChecksum));
  GRADCOMP_CHECK(
      h.codec == format::kCodecQ4 || h.codec == format::kCodecTopK || h.codec == format::kCodecQ2,
      "payload: unknown codec " << int(h.codec));
  GRADCOMP_CHECK(math::dtype_valid(h.dtype) && math::dtype_valid(h.value_dtype),
                 "payload: " << payload_status_message(format::kBadDtype));
  if (h.codec == format::kCodecQ4) {
    GRADCOMP_CHECK(math::q4_block_size_valid(h.param),
                   "payload: q4 block size " << h.param << " is invalid");
    GRADCOMP_CHECK(h.numel < (uint64_t{1} << 62),
                   "payload: element count " << h.numel << " is invalid");
  } else if (h.codec == format::kCodecQ2) {
    GRADCOMP_CHECK(math::q2_block_size_valid(h.param),
                   "payload: q2 block size " << h.param << " is invalid");
    GRADCOMP_CHECK(h.numel < (uint64_t{1} << 62),
                   "payload: element count " << h.numel << " is invalid");
  } else {
    GRADCOMP_CHECK(h.numel <= static_cast<uint64_t>(kTopKMaxNumel),
                   "payload: top-k element count " << h.numel << " is invalid");
  }
  const int status = format::check_header(h, h.codec, h.numel, h.param, h.value_dtype, size);
  GRADCOMP_CHECK(status == format::kPayloadOk, "payload: " << payload_status_message(status));
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
  info.total_bytes = format::payload_bytes_of(h);
  return info;
}

}  // namespace gradcomp
