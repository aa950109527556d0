// GPU tests of top-k in both kernel generations: payloads, residuals and decodes byte-equal to
// the CPU over odd sizes, segments, dtypes, ties and bad payloads. Skipped without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "gpu_test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

// Segment boundaries for a bucket of n elements: one segment, or three with odd lengths (the
// second starts at an element offset that is not 16-byte aligned).
std::vector<int64_t> topk_cuts(int64_t n, bool multi) {
  if (!multi || n < 8) return {0, n};
  return {0, n / 3 + 1, n / 3 + 1 + (n / 5 | 1), n};
}

struct TopKCase {
  DType dtype = DType::kFloat32;
  int64_t n = 0;
  int64_t k = 0;
  int64_t cap = 0;
  bool exact = true;
  DType vd = DType::kFloat32;
  DType rd = DType::kFloat32;
  bool multi = false;
  bool alias = false;    // residual_in == residual_out
  bool residual = true;  // error feedback
  float divisor = 3.0f;
  std::string name() const {
    return std::string(dtype_name(dtype)) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
           " cap=" + std::to_string(cap) + (exact ? " exact" : " approx") +
           " vd=" + dtype_name(vd) + " rd=" + dtype_name(rd) + (multi ? " multi" : "") +
           (alias ? " alias" : "") + (residual ? "" : " no-ef") + " div=" + std::to_string(divisor);
  }
};

// Encodes on the CPU and on `backend`, compares payload and residual bytes, then decodes three
// copies of the payload on both and compares the outputs.
void check_topk_case(Backend& backend, const TopKCase& c, const char* gen) {
  SCOPED_TRACE(std::string(gen) + " " + c.name());
  const int64_t n = c.n;
  std::vector<float> xs = testing::normal_floats(n, static_cast<uint32_t>(n) * 7 + 1);
  if (n > 20) {
    xs[3] = std::nanf("");
    xs[11] = std::numeric_limits<float>::infinity();
    xs[n - 2] = -std::numeric_limits<float>::infinity();
  }
  HostTensor x = HostTensor::from_floats(c.dtype, xs);
  HostTensor r0 = HostTensor::from_floats(c.rd, testing::normal_floats(n, 4, 0.1f));
  const std::vector<int64_t> cuts = topk_cuts(n, c.multi);

  // CPU reference over host segments.
  std::vector<Segment> hsegs;
  for (size_t i = 0; i + 1 < cuts.size(); ++i)
    hsegs.push_back(
        Segment{x.bytes.data() + cuts[i] * dtype_size(c.dtype), cuts[i], cuts[i + 1] - cuts[i]});
  std::vector<uint8_t> ref(topk_payload_bytes(c.cap, c.vd), 0xCD);
  HostTensor rref = r0;
  TopKEncodeParams p;
  p.segments = hsegs.data();
  p.num_segments = static_cast<int>(hsegs.size());
  p.dtype = testing::code(c.dtype);
  p.numel = n;
  p.residual_dtype = testing::code(c.rd);
  if (c.residual) {
    p.residual_in = c.alias ? rref.bytes.data() : r0.bytes.data();
    p.residual_out = rref.bytes.data();
  }
  p.k = c.k;
  p.capacity = static_cast<uint32_t>(c.cap);
  p.exact = c.exact;
  p.value_dtype = testing::code(c.vd);
  p.payload = ref.data();
  cpu::topk_encode(p);

  DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dr(r0.bytes.data(), r0.bytes.size()),
      dout(r0.bytes.data(), r0.bytes.size()), dp(ref.size()), ws(backend.topk_workspace_bytes(n));
  std::vector<Segment> dsegs;
  for (size_t i = 0; i + 1 < cuts.size(); ++i)
    dsegs.push_back(
        Segment{dx.get() + cuts[i] * dtype_size(c.dtype), cuts[i], cuts[i + 1] - cuts[i]});
  p.segments = dsegs.data();
  if (c.residual) {
    p.residual_in = c.alias ? dout.get() : dr.get();
    p.residual_out = dout.get();
  }
  p.payload = dp.get();
  p.workspace = ws.get();
  backend.topk_encode(p);
  const auto got = dp.host();
  ASSERT_EQ(got, ref) << first_difference(got, ref);
  if (c.residual) {
    const auto res = dout.host();
    ASSERT_EQ(res, rref.bytes) << first_difference(res, rref.bytes);
  }

  // Decode W = 3 copies into (possibly split) outputs.
  HostTensor cpu_out(c.dtype, n);
  std::vector<Segment> cout_segs;
  for (size_t i = 0; i + 1 < cuts.size(); ++i)
    cout_segs.push_back(Segment{cpu_out.bytes.data() + cuts[i] * dtype_size(c.dtype), cuts[i],
                                cuts[i + 1] - cuts[i]});
  std::vector<const uint8_t*> cptrs = {ref.data(), ref.data(), ref.data()};
  TopKDecodeParams d = testing::topk_decode_params(cptrs, ref.size(), n, c.cap, c.vd,
                                                   cout_segs.data(), c.dtype, c.divisor);
  d.num_segments = static_cast<int>(cout_segs.size());
  uint32_t cpu_nonfinite = 0;
  d.nonfinite = &cpu_nonfinite;
  cpu::topk_decode(d);
  std::vector<uint8_t> junk(x.bytes.size(), 0x5A);
  DeviceBuffer dy(junk.data(), junk.size());
  std::vector<Segment> gout_segs;
  for (size_t i = 0; i + 1 < cuts.size(); ++i)
    gout_segs.push_back(
        Segment{dy.get() + cuts[i] * dtype_size(c.dtype), cuts[i], cuts[i + 1] - cuts[i]});
  std::vector<const uint8_t*> gptrs = {dp.get(), dp.get(), dp.get()};
  TopKDecodeParams gd = testing::topk_decode_params(gptrs, ref.size(), n, c.cap, c.vd,
                                                    gout_segs.data(), c.dtype, c.divisor);
  gd.num_segments = static_cast<int>(gout_segs.size());
  gd.workspace = ws.get();
  backend.topk_decode(gd);
  EXPECT_EQ(backend.take_decode_status(), cpu_nonfinite != 0);
  const auto y = dy.host();
  ASSERT_EQ(y, cpu_out.bytes) << first_difference(y, cpu_out.bytes);
}

TEST(GpuTopK, BothGenerationsEqualTheCpuByteForByte) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    auto backend = backend_of(g);
    const int64_t sizes[] = {0, 1, 13, 2047, 2048, 2049, 4099, 100003, (1 << 20) + 3};
    for (DType dtype : kDtypes) {
      for (int64_t n : sizes) {
        if (dtype != DType::kFloat32 && n > 100003) continue;
        for (bool exact : {true, false}) {
          TopKOptions o;
          o.exact = exact;
          TopKCase c;
          c.dtype = dtype;
          c.n = n;
          c.exact = exact;
          c.k = topk_k(n, o.ratio);
          c.cap = topk_capacity(n, o);
          check_topk_case(*backend, c, gen_name(g));
          if (n == 0) continue;
          // k = 1 and k = n (exact), every value dtype, split segments, bf16 residuals aliased,
          // no error feedback, a power-of-two divisor.
          TopKCase one = c;
          one.k = one.exact ? 1 : one.k;
          one.cap = one.exact ? 1 : one.cap;
          one.vd = DType::kFloat16;
          check_topk_case(*backend, one, gen_name(g));
          if (exact) {
            TopKCase all = c;
            all.k = all.cap = n;
            all.vd = DType::kBFloat16;
            all.divisor = 4.0f;
            check_topk_case(*backend, all, gen_name(g));
          }
          TopKCase split = c;
          split.multi = true;
          split.rd = DType::kBFloat16;
          split.alias = true;
          split.vd = DType::kBFloat16;
          check_topk_case(*backend, split, gen_name(g));
          TopKCase plain = c;
          plain.residual = false;
          plain.divisor = 0.5f;
          check_topk_case(*backend, plain, gen_name(g));
        }
      }
    }
  }
}

// k = 0 in exact mode on both generations (selects nothing, residuals keep acc).
TEST(GpuTopK, BothGenerationsKZeroEqualTheCpu) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    auto backend = backend_of(g);
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{4099}}) {
      TopKCase c;
      c.n = n;
      c.k = c.cap = 0;
      check_topk_case(*backend, c, gen_name(g));
    }
  }
}

// Ties: every key equal, and a bucket whose large keys fall between the strided sample's points
// (v2's bracket misses and its radix passes run over the whole bucket).
TEST(GpuTopK, BothGenerationsHandleTiesAndBracketMisses) {
  SKIP_WITHOUT_GPU();
  // v2 three times: fused (default), unfused (GRADCOMP_TOPK_FUSED=0) and with the cub::DeviceTopK
  // threshold (GRADCOMP_TOPK_EXACT=cub; the bracket when the build has no CCCL >= 3.3).
  for (int run = 0; run < 4; ++run) {
    const KernelGeneration g = run == 0 ? KernelGeneration::kV1 : KernelGeneration::kV2;
    unsetenv("GRADCOMP_TOPK_FUSED");
    unsetenv("GRADCOMP_TOPK_EXACT");
    if (run == 2) setenv("GRADCOMP_TOPK_FUSED", "0", 1);
    if (run == 3) setenv("GRADCOMP_TOPK_EXACT", "cub", 1);
    auto backend = backend_of(g);
    for (int variant = 0; variant < 2; ++variant) {
      const int64_t n = 409600;
      std::vector<float> xs(n, 0.5f);
      if (variant == 1)
        for (int64_t i = 0; i < n; ++i)
          if (i % 100 != 0) xs[i] = 2.0f + static_cast<float>(i % 7);
      for (int64_t k : {int64_t{1}, int64_t{4096}, n - 5}) {
        HostTensor x = HostTensor::from_floats(DType::kFloat32, xs);
        std::vector<uint8_t> ref(topk_payload_bytes(k, DType::kFloat32));
        std::vector<float> rref(n, 0.0f);
        Segment hs = x.segment();
        TopKEncodeParams p;
        p.segments = &hs;
        p.num_segments = 1;
        p.numel = n;
        p.residual_out = rref.data();
        p.k = k;
        p.capacity = static_cast<uint32_t>(k);
        p.payload = ref.data();
        cpu::topk_encode(p);
        DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dout(n * 4), dp(ref.size()),
            ws(backend->topk_workspace_bytes(n));
        Segment ds{dx.get(), 0, n};
        p.segments = &ds;
        p.residual_out = dout.get();
        p.payload = dp.get();
        p.workspace = ws.get();
        backend->topk_encode(p);
        ASSERT_EQ(dp.host(), ref) << gen_name(g) << " variant " << variant << " k=" << k << " "
                                  << first_difference(dp.host(), ref);
        auto res = dout.host();
        ASSERT_EQ(std::memcmp(res.data(), rref.data(), n * 4), 0) << gen_name(g) << " run " << run;
      }
    }
  }
  unsetenv("GRADCOMP_TOPK_FUSED");
  unsetenv("GRADCOMP_TOPK_EXACT");
}

// A bad index in the second of two payloads: nothing is written, on both generations.
TEST(GpuTopK, BothGenerationsRejectBadIndicesBeforeWriting) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    auto backend = backend_of(g);
    HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(5000, 2));
    auto good = testing::topk_encode_tensor(x, 50, 50, true, DType::kFloat32);
    for (int bad = 0; bad < 2; ++bad) {
      auto enc = good;
      uint32_t* idx = reinterpret_cast<uint32_t*>(enc.payload.data() + kPayloadHeaderBytes);
      if (bad == 0)
        idx[7] = 5000;  // out of range
      else
        idx[9] = idx[8];  // not increasing
      DeviceBuffer d0(good.payload.data(), good.payload.size()),
          d1(enc.payload.data(), enc.payload.size()), ws(backend->topk_workspace_bytes(5000));
      std::vector<float> sentinel(5000, 42.0f);
      DeviceBuffer dy(sentinel.data(), 20000);
      Segment seg{dy.get(), 0, 5000};
      std::vector<const uint8_t*> ptrs = {d0.get(), d1.get()};
      TopKDecodeParams d = testing::topk_decode_params(ptrs, enc.payload.size(), 5000, 50,
                                                       DType::kFloat32, &seg, DType::kFloat32);
      d.workspace = ws.get();
      backend->topk_decode(d);
      EXPECT_THROW(backend->take_decode_status(), Error) << gen_name(g);
      auto out = dy.host();
      EXPECT_EQ(std::memcmp(out.data(), sentinel.data(), 20000), 0) << gen_name(g);
    }
  }
}

}  // namespace
}  // namespace gradcomp
