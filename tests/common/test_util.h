// Helpers shared by the host test suites: single-tensor codec calls and data generators.
#pragma once

#include <cstring>
#include <random>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/format.h"
#include "params.h"

namespace gradcomp {
namespace testing {

// A tensor of any gradcomp dtype stored as raw 16- or 32-bit words.
struct HostTensor {
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  std::vector<uint8_t> bytes;

  HostTensor() = default;
  HostTensor(DType d, int64_t n)
      : dtype(d), numel(n), bytes(static_cast<size_t>(n) * dtype_size(d)) {}
  static HostTensor from_floats(DType d, const std::vector<float>& v) {
    HostTensor t(d, static_cast<int64_t>(v.size()));
    for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), v[i]);
    return t;
  }
  float get(int64_t i) const {
    return math::load_as_float(bytes.data(), i, static_cast<uint8_t>(dtype));
  }
  void set(int64_t i, float v) {
    math::store_from_float(bytes.data(), i, static_cast<uint8_t>(dtype), v);
  }
  void* data() { return bytes.data(); }
  std::vector<float> floats() const {
    std::vector<float> out(static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i) out[i] = get(i);
    return out;
  }
  Segment segment() { return Segment{bytes.data(), 0, numel}; }
};

inline uint8_t code(DType d) {
  return static_cast<uint8_t>(d);
}

inline std::vector<float> normal_floats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

struct Q4Encoded {
  std::vector<uint8_t> payload;
  std::vector<float> residual;  // new residual (fp32), empty without error feedback
};

// Encodes one tensor with q4 or q2 (codec kCodecQ4 or kCodecQ2: the same params structs);
// residual_in may be empty (zeros) and error feedback is on when ef is set.
inline Q4Encoded block_encode_tensor(uint8_t codec, HostTensor& x, int block, bool stochastic,
                                     math::RngKey key, const std::vector<float>& residual_in,
                                     bool ef, int threads) {
  const bool q2 = codec == format::kCodecQ2;
  Q4Encoded out;
  out.payload.assign(q2 ? q2_payload_bytes(x.numel, block) : q4_payload_bytes(x.numel, block),
                     0xAB);
  Segment seg = x.segment();
  Q4EncodeParams p;
  p.codec = codec;
  p.segments = &seg;
  p.num_segments = 1;
  p.dtype = code(x.dtype);
  p.numel = x.numel;
  p.block_size = static_cast<uint32_t>(block);
  p.stochastic = stochastic;
  p.rng = key;
  p.payload = out.payload.data();
  if (!residual_in.empty()) p.residual_in = residual_in.data();
  if (ef) {
    out.residual.assign(static_cast<size_t>(x.numel), 0.0f);
    p.residual_out = out.residual.data();
  }
  if (q2) {
    cpu::q2_encode(p, threads);
  } else {
    cpu::q4_encode(p, threads);
  }
  return out;
}

inline HostTensor block_decode_payloads(uint8_t codec,
                                        const std::vector<const std::vector<uint8_t>*>& payloads,
                                        int64_t numel, int block, DType out_dtype, float divisor) {
  HostTensor out(out_dtype, numel);
  Segment seg = out.segment();
  std::vector<const uint8_t*> ptrs;
  for (auto* p : payloads) ptrs.push_back(p->data());
  Q4DecodeParams d;
  d.codec = codec;
  d.payloads = ptrs.data();
  d.num_payloads = static_cast<int>(ptrs.size());
  d.payload_bytes = payloads[0]->size();
  d.numel = numel;
  d.block_size = static_cast<uint32_t>(block);
  d.segments = &seg;
  d.num_segments = 1;
  d.dtype = code(out_dtype);
  d.divisor = divisor;
  if (codec == format::kCodecQ2) {
    cpu::q2_decode(d);
  } else {
    cpu::q4_decode(d);
  }
  return out;
}

inline Q4Encoded q4_encode_tensor(HostTensor& x, int block, bool stochastic, math::RngKey key,
                                  const std::vector<float>& residual_in = {}, bool ef = false,
                                  int threads = 1) {
  return block_encode_tensor(format::kCodecQ4, x, block, stochastic, key, residual_in, ef, threads);
}

inline HostTensor q4_decode_payloads(const std::vector<const std::vector<uint8_t>*>& payloads,
                                     int64_t numel, int block, DType out_dtype,
                                     float divisor = 1.0f) {
  return block_decode_payloads(format::kCodecQ4, payloads, numel, block, out_dtype, divisor);
}

inline Q4Encoded q2_encode_tensor(HostTensor& x, int block, bool stochastic, math::RngKey key,
                                  const std::vector<float>& residual_in = {}, bool ef = false,
                                  int threads = 1) {
  return block_encode_tensor(format::kCodecQ2, x, block, stochastic, key, residual_in, ef, threads);
}

inline HostTensor q2_decode_payloads(const std::vector<const std::vector<uint8_t>*>& payloads,
                                     int64_t numel, int block, DType out_dtype,
                                     float divisor = 1.0f) {
  return block_decode_payloads(format::kCodecQ2, payloads, numel, block, out_dtype, divisor);
}

inline float q4_step_of_block(const std::vector<uint8_t>& payload, int64_t block_index) {
  float s;
  std::memcpy(&s, payload.data() + kPayloadHeaderBytes + 4 * block_index, 4);
  return s;
}

struct TopKEncoded {
  std::vector<uint8_t> payload;
  std::vector<float> residual;
  uint64_t count = 0;
  std::vector<uint32_t> indices() const {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(payload.data() + kPayloadHeaderBytes);
    return std::vector<uint32_t>(p, p + count);
  }
};

inline TopKEncoded topk_encode_tensor(HostTensor& x, int64_t k, int64_t capacity, bool exact,
                                      DType value_dtype, const std::vector<float>& residual_in = {},
                                      bool ef = true) {
  TopKEncoded out;
  out.payload.assign(topk_payload_bytes(capacity, value_dtype), 0xCD);
  Segment seg = x.segment();
  TopKEncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.dtype = code(x.dtype);
  p.numel = x.numel;
  p.k = k;
  p.capacity = static_cast<uint32_t>(capacity);
  p.exact = exact;
  p.value_dtype = code(value_dtype);
  p.payload = out.payload.data();
  if (!residual_in.empty()) p.residual_in = residual_in.data();
  if (ef) {
    out.residual.assign(static_cast<size_t>(x.numel), 0.0f);
    p.residual_out = out.residual.data();
  }
  out.count = cpu::topk_encode(p);
  return out;
}

inline TopKDecodeParams topk_decode_params(const std::vector<const uint8_t*>& ptrs, uint64_t bytes,
                                           int64_t numel, int64_t capacity, DType value_dtype,
                                           Segment* out, DType out_dtype, float divisor = 1.0f) {
  TopKDecodeParams d;
  d.payloads = ptrs.data();
  d.num_payloads = static_cast<int>(ptrs.size());
  d.payload_bytes = bytes;
  d.numel = numel;
  d.capacity = static_cast<uint32_t>(capacity);
  d.value_dtype = code(value_dtype);
  d.segments = out;
  d.num_segments = 1;
  d.dtype = code(out_dtype);
  d.divisor = divisor;
  return d;
}

inline bool same_bits(float a, float b) {
  return math::float_bits(a) == math::float_bits(b);
}

inline const std::vector<int64_t>& edge_lengths() {
  static const std::vector<int64_t> v = {0, 1, 13, 63, 64, 65, 255, 256, 257, 4099, (1 << 20) + 3};
  return v;
}

}  // namespace testing
}  // namespace gradcomp
