// The GPU tests' block-codec cases (q4, q2): segment layouts over every path the v2 kernels choose
// between, and one case encoded and decoded on the CPU and a CUDA backend, compared byte for byte.
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace gradcomp {

enum class Layout { kAligned, kMisaligned, kSplit };

inline const char* layout_name(Layout l) {
  return l == Layout::kAligned ? "aligned" : l == Layout::kMisaligned ? "misaligned" : "split";
}

// Segments over `base` (room for `total` + 4 elements of `dtype`): one at the start, one an
// element past a 16-byte address, or pieces split at 3, 300, 301 and 901 with an element's gap
// after each (so the piece at 301, longer than a warp span, starts misaligned and the one at
// 901 aligned again).
inline std::vector<Segment> segments_over(uint8_t* base, DType dtype, int64_t total, Layout l) {
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  if (l == Layout::kAligned) return {Segment{base, 0, total}};
  if (l == Layout::kMisaligned) return {Segment{base + es, 0, total}};
  std::vector<int64_t> bounds{0};
  for (int64_t cut : {3, 300, 301, 901})
    if (cut < total) bounds.push_back(cut);
  bounds.push_back(total);
  std::vector<Segment> s;
  for (size_t i = 0; i + 1 < bounds.size(); ++i)
    s.push_back(Segment{base + (bounds[i] + static_cast<int64_t>(i)) * es, bounds[i],
                        bounds[i + 1] - bounds[i]});
  return s;
}

// The same segments moved from one base address to another.
inline std::vector<Segment> rebased(std::vector<Segment> s, const uint8_t* from, uint8_t* to) {
  for (Segment& x : s) x.data = to + (static_cast<const uint8_t*>(x.data) - from);
  return s;
}

struct BlockCase {
  DType dtype;
  DType rdtype;
  bool residual;
  bool alias;
  int block;
  int64_t begin;
  int64_t n;
  Layout layout;
  bool stochastic;
  std::string name() const {
    return std::string(dtype_name(dtype)) + " res=" + (residual ? dtype_name(rdtype) : "none") +
           (alias ? " alias" : "") + " block=" + std::to_string(block) +
           " begin=" + std::to_string(begin) + " n=" + std::to_string(n) + " " +
           layout_name(layout) + (stochastic ? " sr" : " nearest");
  }
};

// Encodes with `codec` (q4 or q2) on the CPU and on `backend`, then decodes W = 1, 3 and 4 copies
// (the two divisor paths) into the same layout on both.
inline void check_block_case(Backend& backend, uint8_t codec, const BlockCase& c) {
  SCOPED_TRACE(c.name());
  const bool q2 = codec == format::kCodecQ2;
  const int64_t total = c.begin + c.n;
  const size_t es = dtype_size(c.dtype);
  std::vector<float> xs = testing::normal_floats(total, static_cast<uint32_t>(total * 3 + c.block));
  if (total > c.begin + 70) xs[c.begin + 70] = std::numeric_limits<float>::infinity();
  testing::HostTensor x = testing::HostTensor::from_floats(c.dtype, xs);
  x.bytes.resize(x.bytes.size() + 4 * es, 0);  // room for the shifted layouts
  const std::vector<Segment> hsegs = segments_over(x.bytes.data(), c.dtype, total, c.layout);
  testing::HostTensor r0 =
      testing::HostTensor::from_floats(c.rdtype, testing::normal_floats(c.n, 9, 0.1f));
  testing::HostTensor rref = r0;
  std::vector<uint8_t> ref(q2 ? q2_payload_bytes(c.n, c.block) : q4_payload_bytes(c.n, c.block),
                           0xCD);
  Q4EncodeParams p;
  p.codec = codec;
  p.segments = hsegs.data();
  p.num_segments = static_cast<int>(hsegs.size());
  p.dtype = testing::code(c.dtype);
  p.begin = c.begin;
  p.numel = c.n;
  p.block_size = static_cast<uint32_t>(c.block);
  p.stochastic = c.stochastic;
  p.rng = {0xABCDEF12345ULL, 4, 2, 1, 0};
  p.residual_dtype = testing::code(c.rdtype);
  if (c.residual) {
    p.residual_in = c.alias ? rref.bytes.data() : r0.bytes.data();
    p.residual_out = rref.bytes.data();
  }
  p.payload = ref.data();
  if (q2)
    cpu::q2_encode(p);
  else
    cpu::q4_encode(p);

  DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dr(r0.bytes.data(), r0.bytes.size() + 16),
      dout(r0.bytes.data(), r0.bytes.size() + 16), dp(ref.size());
  const std::vector<Segment> dsegs = rebased(hsegs, x.bytes.data(), dx.get());
  p.segments = dsegs.data();
  if (c.residual) {
    p.residual_in = c.alias ? dout.get() : dr.get();
    p.residual_out = dout.get();
  }
  p.payload = dp.get();
  backend.q4_encode(p);
  const auto got = dp.host();
  ASSERT_EQ(got, ref) << first_difference(got, ref);
  if (c.residual) {
    auto res = dout.host();
    res.resize(rref.bytes.size());
    ASSERT_EQ(res, rref.bytes) << first_difference(res, rref.bytes);
  }

  for (int w : {1, 3, 4}) {
    SCOPED_TRACE("W=" + std::to_string(w));
    std::vector<uint8_t> yh(x.bytes.size(), 0x5A);
    const std::vector<Segment> ysegs = segments_over(yh.data(), c.dtype, total, c.layout);
    std::vector<const uint8_t*> hp(static_cast<size_t>(w), ref.data());
    Q4DecodeParams d;
    d.codec = codec;
    d.payloads = hp.data();
    d.num_payloads = w;
    d.payload_bytes = ref.size();
    d.numel = c.n;
    d.block_size = static_cast<uint32_t>(c.block);
    d.segments = ysegs.data();
    d.num_segments = static_cast<int>(ysegs.size());
    d.dtype = testing::code(c.dtype);
    d.begin = c.begin;
    d.divisor = static_cast<float>(w);
    if (q2)
      cpu::q2_decode(d);
    else
      cpu::q4_decode(d);
    DeviceBuffer dy(std::vector<uint8_t>(x.bytes.size(), 0x5A).data(), x.bytes.size());
    const std::vector<Segment> dysegs = rebased(ysegs, yh.data(), dy.get());
    std::vector<const uint8_t*> dptrs(static_cast<size_t>(w), dp.get());
    d.payloads = dptrs.data();
    d.segments = dysegs.data();
    backend.q4_decode(d);
    EXPECT_EQ(backend.take_decode_status(), total > c.begin + 70);
    const auto y = dy.host();
    ASSERT_EQ(y, yh) << first_difference(y, yh);
  }
}

}  // namespace gradcomp
