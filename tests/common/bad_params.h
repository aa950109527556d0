// Params that break one rule each, for checking that every backend refuses them alike.
#pragma once

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "gradcomp/backend.h"
#include "gradcomp/format.h"

namespace gradcomp {
namespace testing {

// Memory a case points its params at: `data` holds kBadParamsNumel floats, `payload` one q4 or
// top-k payload of them; both of the backend's kind. Cases never get as far as touching it.
struct BadParamsMemory {
  void* data = nullptr;
  uint8_t* payload = nullptr;
  void* workspace = nullptr;
};

constexpr int64_t kBadParamsNumel = 1024;

struct BadParamsCase {
  const char* name;
  const char* expect;  // a part of the message
  std::function<void(Backend&, const BadParamsMemory&)> call;
};

// A scan of one 10-element segment of the case memory with the given dtype and count. The
// segment table lives in static storage: the params outlive this call.
inline NonfiniteScanParams scan_params(const BadParamsMemory& m, uint8_t dtype, int64_t numel) {
  static Segment seg;
  seg = Segment{m.data, 0, 10};
  NonfiniteScanParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.dtype = dtype;
  p.numel = numel;
  return p;
}

inline uint64_t bad_params_payload_bytes() {
  return q4_payload_bytes(kBadParamsNumel, 16);
}

// A valid accumulate of the case memory but for momentum and clip threshold. The segment table
// lives in static storage: the params outlive this call.
inline TopKAccumulateParams accumulate_params(const BadParamsMemory& m, float momentum,
                                              float clip) {
  thread_local Segment seg;
  seg = Segment{m.data, 0, kBadParamsNumel};
  TopKAccumulateParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.numel = kBadParamsNumel;
  p.momentum = momentum;
  p.clip_threshold = clip;
  p.out = static_cast<float*>(m.workspace);
  p.scratch = static_cast<float*>(m.workspace);
  return p;
}

// Valid baselines, each case breaking one field.
inline std::vector<BadParamsCase> bad_params_cases() {
  struct Q4E {
    Segment seg;
    Q4EncodeParams p;
    Q4E(const BadParamsMemory& m) : seg{m.data, 0, kBadParamsNumel} {
      p.segments = &seg;
      p.num_segments = 1;
      p.numel = kBadParamsNumel;
      p.payload = m.payload;
    }
  };
  struct Q4D {
    Segment seg;
    const uint8_t* ptrs[1];
    Q4DecodeParams p;
    Q4D(const BadParamsMemory& m) : seg{m.data, 0, kBadParamsNumel}, ptrs{m.payload} {
      p.payloads = ptrs;
      p.num_payloads = 1;
      p.payload_bytes = q4_payload_bytes(kBadParamsNumel, 64);
      p.numel = kBadParamsNumel;
      p.segments = &seg;
      p.num_segments = 1;
    }
  };
  struct TKE {
    Segment seg;
    TopKEncodeParams p;
    TKE(const BadParamsMemory& m) : seg{m.data, 0, kBadParamsNumel} {
      p.segments = &seg;
      p.num_segments = 1;
      p.numel = kBadParamsNumel;
      p.k = 10;
      p.capacity = 10;
      p.payload = m.payload;
      p.workspace = m.workspace;
    }
  };
  struct TKD {
    Segment seg;
    const uint8_t* ptrs[1];
    TopKDecodeParams p;
    TKD(const BadParamsMemory& m) : seg{m.data, 0, kBadParamsNumel}, ptrs{m.payload} {
      p.payloads = ptrs;
      p.num_payloads = 1;
      p.payload_bytes = topk_payload_bytes(10, DType::kFloat32);
      p.numel = kBadParamsNumel;
      p.capacity = 10;
      p.segments = &seg;
      p.num_segments = 1;
      p.workspace = m.workspace;
    }
  };
  using M = const BadParamsMemory&;
  return {
      {"q4 encode dtype", "input dtype code",
       [](Backend& b, M m) {
         Q4E e(m);
         e.p.dtype = 3;
         b.q4_encode(e.p);
       }},
      {"q4 encode residual dtype", "residual dtype code",
       [](Backend& b, M m) {
         Q4E e(m);
         e.p.residual_out = m.workspace;
         e.p.residual_dtype = 7;
         b.q4_encode(e.p);
       }},
      {"q4 encode block 48", "power of two",
       [](Backend& b, M m) {
         Q4E e(m);
         e.p.block_size = 48;
         b.q4_encode(e.p);
       }},
      {"q4 encode block 512", "power of two",
       [](Backend& b, M m) {
         Q4E e(m);
         e.p.block_size = 512;
         b.q4_encode(e.p);
       }},
      {"q4 encode negative count", "negative",
       [](Backend& b, M m) {
         Q4E e(m);
         e.p.numel = -1;
         b.q4_encode(e.p);
       }},
      {"q4 encode unaligned start", "multiple of the block size",
       [](Backend& b, M m) {
         Q4E e(m);
         e.p.begin = 10;
         e.p.numel = 100;
         b.q4_encode(e.p);
       }},
      {"q4 encode no payload", "payload is null",
       [](Backend& b, M m) {
         Q4E e(m);
         e.p.payload = nullptr;
         b.q4_encode(e.p);
       }},
      {"q4 encode past the segment", "outside the segments",
       [](Backend& b, M m) {
         Q4E e(m);
         e.p.numel = kBadParamsNumel + 1;
         b.q4_encode(e.p);
       }},
      {"q4 encode segment gap", "contiguous",
       [](Backend& b, M m) {
         Segment segs[2] = {{m.data, 0, 512}, {m.data, 600, 512}};
         Q4E e(m);
         e.p.segments = segs;
         e.p.num_segments = 2;
         b.q4_encode(e.p);
       }},
      {"q4 encode segment without data", "has no data",
       [](Backend& b, M m) {
         Q4E e(m);
         e.seg.data = nullptr;
         b.q4_encode(e.p);
       }},
      {"q4 decode no payloads", "no payloads",
       [](Backend& b, M m) {
         Q4D d(m);
         d.p.num_payloads = 0;
         b.q4_decode(d.p);
       }},
      {"q4 decode short payloads", "shorter than the 64-byte header",
       [](Backend& b, M m) {
         Q4D d(m);
         d.p.payload_bytes = 10;
         b.q4_decode(d.p);
       }},
      {"q4 decode dtype", "output dtype code",
       [](Backend& b, M m) {
         Q4D d(m);
         d.p.dtype = 5;
         b.q4_decode(d.p);
       }},
      {"q4 decode block", "power of two",
       [](Backend& b, M m) {
         Q4D d(m);
         d.p.block_size = 100;
         b.q4_decode(d.p);
       }},
      {"q4 decode null payload", "payload 0 is null",
       [](Backend& b, M m) {
         Q4D d(m);
         d.ptrs[0] = nullptr;
         b.q4_decode(d.p);
       }},
      {"q4 decode past the segment", "outside the segments",
       [](Backend& b, M m) {
         Q4D d(m);
         d.p.begin = 1;
         b.q4_decode(d.p);
       }},
      {"top-k encode k > n", "k is outside",
       [](Backend& b, M m) {
         TKE e(m);
         e.p.k = kBadParamsNumel + 1;
         b.topk_encode(e.p);
       }},
      {"top-k encode negative k", "k is outside",
       [](Backend& b, M m) {
         TKE e(m);
         e.p.k = -1;
         b.topk_encode(e.p);
       }},
      {"top-k encode capacity", "capacity exceeds",
       [](Backend& b, M m) {
         TKE e(m);
         e.p.exact = false;
         e.p.capacity = kBadParamsNumel + 1;
         b.topk_encode(e.p);
       }},
      {"top-k encode exact capacity", "capacity must equal k",
       [](Backend& b, M m) {
         TKE e(m);
         e.p.capacity = 11;
         b.topk_encode(e.p);
       }},
      {"top-k encode 2^31 elements", "2^31",
       [](Backend& b, M m) {
         TKE e(m);
         e.seg.numel = e.p.numel = int64_t{1} << 31;
         b.topk_encode(e.p);
       }},
      {"top-k encode value dtype", "value dtype code",
       [](Backend& b, M m) {
         TKE e(m);
         e.p.value_dtype = 9;
         b.topk_encode(e.p);
       }},
      {"top-k encode no payload", "payload is null",
       [](Backend& b, M m) {
         TKE e(m);
         e.p.payload = nullptr;
         b.topk_encode(e.p);
       }},
      {"top-k encode no workspace", "no workspace",
       [](Backend& b, M m) {
         TKE e(m);
         e.p.workspace = nullptr;
         b.topk_encode(e.p);
       }},
      {"top-k decode short payloads", "shorter than the 64-byte header",
       [](Backend& b, M m) {
         TKD d(m);
         d.p.payload_bytes = 0;
         b.topk_decode(d.p);
       }},
      {"top-k decode value dtype", "value dtype code",
       [](Backend& b, M m) {
         TKD d(m);
         d.p.value_dtype = 4;
         b.topk_decode(d.p);
       }},
      {"top-k decode no workspace", "no workspace",
       [](Backend& b, M m) {
         TKD d(m);
         d.p.workspace = nullptr;
         b.topk_decode(d.p);
       }},
      {"top-k decode null payload", "payload 0 is null",
       [](Backend& b, M m) {
         TKD d(m);
         d.ptrs[0] = nullptr;
         b.topk_decode(d.p);
       }},
      {"payload check no payloads", "no payloads",
       [](Backend& b, M m) {
         const uint8_t* ptrs[1] = {m.payload};
         PayloadCheckParams c;
         c.payloads = ptrs;
         c.payload_bytes = bad_params_payload_bytes();
         b.check_payloads(c);
       }},
      {"payload check codec", "unknown codec",
       [](Backend& b, M m) {
         const uint8_t* ptrs[1] = {m.payload};
         const int64_t numel[1] = {kBadParamsNumel};
         PayloadCheckParams c;
         c.payloads = ptrs;
         c.num_payloads = 1;
         c.payload_bytes = bad_params_payload_bytes();
         c.numel = numel;
         c.codec = 9;
         b.check_payloads(c);
       }},
      {"end_bucket pairs", "kMaxPairs",
       [](Backend& b, M) {
         ResidualPair pairs[EndBucketParams::kMaxPairs + 1];
         b.end_bucket(pairs, EndBucketParams::kMaxPairs + 1);
       }},
      {"end_bucket negative", "kMaxPairs", [](Backend& b, M) { b.end_bucket(nullptr, -1); }},
      {"top-k accumulate momentum 1", "momentum is outside",
       [](Backend& b, M m) { b.topk_accumulate(accumulate_params(m, 1.0f, 0.0f)); }},
      {"top-k accumulate negative clip", "clip threshold",
       [](Backend& b, M m) { b.topk_accumulate(accumulate_params(m, 0.5f, -1.0f)); }},
      {"top-k accumulate NaN clip", "clip threshold",
       [](Backend& b, M m) { b.topk_accumulate(accumulate_params(m, 0.5f, NAN)); }},
      {"top-k accumulate no output", "output is null",
       [](Backend& b, M m) {
         TopKAccumulateParams p = accumulate_params(m, 0.5f, 0.0f);
         p.out = nullptr;
         b.topk_accumulate(p);
       }},
      {"top-k mask capacity", "capacity exceeds",
       [](Backend& b, M m) {
         TopKMaskParams p;
         p.payload = m.payload;
         p.numel = 10;
         p.capacity = 11;
         p.target = static_cast<float*>(m.workspace);
         b.topk_mask(p);
       }},
      {"top-k mask no payload", "payload is null",
       [](Backend& b, M m) {
         TopKMaskParams p;
         p.numel = 10;
         p.target = static_cast<float*>(m.workspace);
         b.topk_mask(p);
       }},
      {"non-finite scan dtype", "dtype code",
       [](Backend& b, M m) { b.scan_nonfinite(scan_params(m, 9, 10)); }},
      {"non-finite scan range", "outside the segments",
       [](Backend& b, M m) { b.scan_nonfinite(scan_params(m, math::kDtypeF32, 11)); }},
      {"non-finite scan short count", "the segments hold 10 elements",
       [](Backend& b, M m) { b.scan_nonfinite(scan_params(m, math::kDtypeF32, 9)); }},
  };
}

// The message a case's call raised ("" when it raised none).
inline std::string rejection(const BadParamsCase& c, Backend& backend, const BadParamsMemory& m) {
  try {
    c.call(backend, m);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace testing
}  // namespace gradcomp
