// Helpers of the CPU codecs: fp32 staging of segment lists, and payload header validation.
#pragma once

#include <algorithm>
#include <cstring>
#include <sstream>

#include "gradcomp/format.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace cpu {
namespace detail {

// Elements staged through fp32 at a time: small enough to stay in L1/L2 between passes.
constexpr int64_t kStagingElements = 4096;

// Converts n elements starting at base[first] to fp32; the dtype branch stays out of the loop.
inline void load_floats(const void* base, int64_t first, int64_t n, uint8_t dtype, float* out) {
  if (dtype == math::kDtypeF32) {
    std::memcpy(out, static_cast<const float*>(base) + first, static_cast<size_t>(n) * 4);
  } else if (dtype == math::kDtypeF16) {
    const uint16_t* in = static_cast<const uint16_t*>(base) + first;
    for (int64_t i = 0; i < n; ++i) out[i] = math::half_to_float(in[i]);
  } else {
    const uint16_t* in = static_cast<const uint16_t*>(base) + first;
    for (int64_t i = 0; i < n; ++i) out[i] = math::bf16_to_float(in[i]);
  }
}

inline void store_floats(void* base, int64_t first, int64_t n, uint8_t dtype, const float* in) {
  if (dtype == math::kDtypeF32) {
    std::memcpy(static_cast<float*>(base) + first, in, static_cast<size_t>(n) * 4);
  } else if (dtype == math::kDtypeF16) {
    uint16_t* out = static_cast<uint16_t*>(base) + first;
    for (int64_t i = 0; i < n; ++i) out[i] = math::float_to_half(in[i]);
  } else {
    uint16_t* out = static_cast<uint16_t*>(base) + first;
    for (int64_t i = 0; i < n; ++i) out[i] = math::float_to_bf16(in[i]);
  }
}

// Reads and writes elements of a flattened segment list in contiguous runs.
class SegmentView {
 public:
  SegmentView(const Segment* segments, int count, uint8_t dtype)
      : segments_(segments), count_(count), dtype_(dtype) {}

  // Copies elements [first, first + n) of the flattened view into out as fp32.
  void gather(int64_t first, int64_t n, float* out) const {
    for_runs(first, n, [&](const Segment& s, int64_t local, int64_t done, int64_t len) {
      load_floats(s.data, local, len, dtype_, out + done);
    });
  }

  // Elements [first, first + n) as a pointer into one fp32 segment, or null when they are
  // another dtype or span segments (then gather / scatter through a staging buffer).
  float* fp32_run(int64_t first, int64_t n) const {
    return dtype_ == math::kDtypeF32 ? static_cast<float*>(run(first, n)) : nullptr;
  }

  // Elements [first, first + n) as raw memory of one segment (of the view's dtype), or null.
  void* run(int64_t first, int64_t n) const {
    if (n == 0) return nullptr;
    const Segment* end = segments_ + count_;
    const Segment* s = std::upper_bound(
        segments_, end, first, [](int64_t v, const Segment& seg) { return v < seg.offset; });
    if (s == segments_) return nullptr;
    --s;
    if (first < s->offset || first + n > s->offset + s->numel) return nullptr;
    return static_cast<char*>(s->data) + (first - s->offset) * math::dtype_bytes(dtype_);
  }

  // Writes fp32 values to elements [first, first + n), rounding to the view's dtype.
  void scatter(int64_t first, int64_t n, const float* in) const {
    for_runs(first, n, [&](const Segment& s, int64_t local, int64_t done, int64_t len) {
      store_floats(s.data, local, len, dtype_, in + done);
    });
  }

  // Writes `value`, rounded to the view's dtype, to elements [first, first + n).
  void fill(int64_t first, int64_t n, float value) const {
    for_runs(first, n, [&](const Segment& s, int64_t local, int64_t, int64_t len) {
      if (dtype_ == math::kDtypeF32) {
        float* out = static_cast<float*>(s.data) + local;
        std::fill(out, out + len, value);
      } else {
        const uint16_t bits =
            dtype_ == math::kDtypeF16 ? math::float_to_half(value) : math::float_to_bf16(value);
        uint16_t* out = static_cast<uint16_t*>(s.data) + local;
        std::fill(out, out + len, bits);
      }
    });
  }

  // Writes one fp32 value to element `index`, rounding to the view's dtype.
  void store(int64_t index, float value) const {
    for_runs(index, 1, [&](const Segment& s, int64_t local, int64_t, int64_t) {
      store_floats(s.data, local, 1, dtype_, &value);
    });
  }

 private:
  template <typename F>
  void for_runs(int64_t first, int64_t n, F&& f) const {
    if (n == 0) return;
    const Segment* end = segments_ + count_;
    const Segment* s = std::upper_bound(
        segments_, end, first, [](int64_t v, const Segment& seg) { return v < seg.offset; });
    GRADCOMP_CHECK(s != segments_, "element " << first << " lies before the first segment");
    --s;
    int64_t done = 0;
    while (done < n) {
      GRADCOMP_CHECK(s != end, "element " << first + done << " lies past the last segment");
      int64_t local = first + done - s->offset;
      int64_t len = std::min(n - done, s->numel - local);
      if (len > 0) {
        f(*s, local, done, len);
        done += len;
      }
      ++s;
    }
  }

  const Segment* segments_;
  int count_;
  uint8_t dtype_;
};

// Checks every payload's header and body checksum against the layout the decoder expects,
// before anything is written. Payload w came from rank w in every collective; numel_of(w) is its
// element count.
template <typename NumelOf>
void validate_payloads(const uint8_t* const* payloads, int num_payloads, uint64_t payload_bytes,
                       uint8_t codec, NumelOf&& numel_of, uint32_t param, uint8_t value_dtype,
                       const char* what) {
  for (int w = 0; w < num_payloads; ++w) {
    const format::PayloadHeader h = format::read_header(payloads[w]);
    const uint64_t numel = static_cast<uint64_t>(numel_of(w));
    int status = format::check_header(h, codec, numel, param, value_dtype, payload_bytes);
    if (status == format::kPayloadOk &&
        format::body_checksum(payloads[w], format::payload_bytes_of(h)) != h.body_checksum)
      status = format::kBadBodyChecksum;
    if (status != format::kPayloadOk) {
      std::ostringstream message;
      message << what << ": payload " << w << " (from rank " << w
              << ") rejected: " << payload_status_message(status);
      throw PayloadError(message.str());
    }
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
