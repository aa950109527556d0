// GPU tests of q4 in both kernel generations over every path the v2 kernels choose between: one
// aligned segment, one misaligned, several (edges inside spans), ranges that start past 0, every
// residual dtype and aliasing, block sizes, grids of one and a few blocks (the seal), W payloads.
// Payloads, residuals and outputs byte-equal to the CPU. Skipped without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "gpu_test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

enum class Layout { kAligned, kMisaligned, kSplit };

const char* layout_name(Layout l) {
  return l == Layout::kAligned ? "aligned" : l == Layout::kMisaligned ? "misaligned" : "split";
}

// Segments over `base` (room for `total` + 4 elements of `dtype`): one at the start, one an
// element past a 16-byte address, or pieces split at 3, 300, 301 and 901 with an element's gap
// after each (so the piece at 301, longer than a warp span, starts misaligned and the one at
// 901 aligned again).
std::vector<Segment> segments_over(uint8_t* base, DType dtype, int64_t total, Layout l) {
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
std::vector<Segment> rebased(std::vector<Segment> s, const uint8_t* from, uint8_t* to) {
  for (Segment& x : s) x.data = to + (static_cast<const uint8_t*>(x.data) - from);
  return s;
}

struct Q4Case {
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

// Encodes on the CPU and on `backend`, then decodes W = 1, 3 and 4 copies (the two divisor
// paths) into the same layout on both.
void check_q4_case(Backend& backend, const Q4Case& c) {
  SCOPED_TRACE(c.name());
  const int64_t total = c.begin + c.n;
  const size_t es = dtype_size(c.dtype);
  std::vector<float> xs = testing::normal_floats(total, static_cast<uint32_t>(total * 3 + c.block));
  if (total > c.begin + 70) xs[c.begin + 70] = std::numeric_limits<float>::infinity();
  HostTensor x = HostTensor::from_floats(c.dtype, xs);
  x.bytes.resize(x.bytes.size() + 4 * es, 0);  // room for the shifted layouts
  const std::vector<Segment> hsegs = segments_over(x.bytes.data(), c.dtype, total, c.layout);
  HostTensor r0 = HostTensor::from_floats(c.rdtype, testing::normal_floats(c.n, 9, 0.1f));
  HostTensor rref = r0;
  std::vector<uint8_t> ref(q4_payload_bytes(c.n, c.block), 0xCD);
  Q4EncodeParams p;
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

TEST(GpuQ4, BothGenerationsEqualTheCpuOnEveryPath) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    SCOPED_TRACE(gen_name(g));
    auto backend = backend_of(g);
    for (DType dtype : kDtypes) {
      for (Layout layout : {Layout::kAligned, Layout::kMisaligned, Layout::kSplit}) {
        for (int64_t n : {0, 1, 255, 256, 257, 1000, 4099, 70001}) {
          check_q4_case(*backend, {dtype, DType::kFloat32, true, false, 64, 0, n, layout, true});
          check_q4_case(*backend, {dtype, DType::kBFloat16, true, true, 64, 128, n, layout, false});
        }
      }
      for (int block : {16, 32, 128, 256}) {
        for (DType rd : kDtypes) {
          check_q4_case(*backend,
                        {dtype, rd, true, false, block, 2 * block, 5000, Layout::kSplit, true});
          check_q4_case(*backend, {dtype, rd, true, true, block, 0, 4096, Layout::kAligned, true});
        }
        check_q4_case(*backend, {dtype, DType::kFloat32, false, false, block, 0, 3001,
                                 Layout::kMisaligned, false});
      }
    }
  }
}

// A grid of one block and of three: every block's checksum terms reach the header, and the one
// that finishes last seals it, whichever it is.
TEST(GpuQ4, BothGenerationsSealWithFewBlocks) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    for (int ctas : {1, 3}) {
      SCOPED_TRACE(std::string(gen_name(g)) + " ctas=" + std::to_string(ctas));
      cuda::CudaBackendOptions o;
      o.kernels = g;
      o.max_encode_ctas = ctas;
      auto backend = cuda::make_cuda_backend(o);
      for (int64_t n : {1, 2048, 100003})
        check_q4_case(*backend, {DType::kFloat32, DType::kFloat32, true, false, 64, 0, n,
                                 Layout::kAligned, true});
    }
  }
}

// The same bytes every time: the seal's order of atomic additions cannot change the sum.
TEST(GpuQ4, V2EncodeIsDeterministicAcrossRuns) {
  SKIP_WITHOUT_GPU();
  auto backend = backend_of(KernelGeneration::kV2);
  const int64_t n = (1 << 22) + 77;
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 5));
  DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dp(q4_payload_bytes(n, 64));
  Segment seg{dx.get(), 0, n};
  Q4EncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.numel = n;
  p.rng = {1, 2, 3, 4, 0};
  p.payload = dp.get();
  backend->q4_encode(p);
  const auto first = dp.host();
  for (int run = 0; run < 5; ++run) {
    backend->q4_encode(p);
    ASSERT_EQ(dp.host(), first) << "run " << run;
  }
  EXPECT_EQ(first, testing::q4_encode_tensor(x, 64, true, {1, 2, 3, 4, 0}).payload);
}

}  // namespace
}  // namespace gradcomp
