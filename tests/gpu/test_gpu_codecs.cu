// GPU tests: CUDA payloads byte-identical to CPU payloads; fusion, decoding, hardening, NCCL.
// Without a CUDA device every test here reports as skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "gradcomp/collectives.h"
#include "gradcomp/cuda.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/nccl_communicator.h"
#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

#define SKIP_WITHOUT_GPU() \
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device on this machine"

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    GRADCOMP_CUDA_CHECK(cudaMalloc(&ptr_, bytes ? bytes : 16));
  }
  // The backends run on streams of their own (non-blocking ones among them), which plain
  // cudaMemcpy does not wait for: the device is synchronized around every copy.
  DeviceBuffer(const void* host, size_t bytes) : DeviceBuffer(bytes) {
    GRADCOMP_CUDA_CHECK(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  std::vector<uint8_t> host() const {
    std::vector<uint8_t> v(bytes_);
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
    GRADCOMP_CUDA_CHECK(cudaMemcpy(v.data(), ptr_, bytes_, cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Where two byte strings first differ, as 32-bit words around it (gtest prints only the start).
std::string first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size())
    return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  size_t i = 0;
  while (i < a.size() && a[i] == b[i]) ++i;
  if (i == a.size()) return "equal";
  const size_t word = i / 4 * 4;
  char text[160];
  uint32_t wa = 0, wb = 0;
  std::memcpy(&wa, a.data() + word, std::min<size_t>(4, a.size() - word));
  std::memcpy(&wb, b.data() + word, std::min<size_t>(4, b.size() - word));
  std::snprintf(text, sizeof text, "first difference at byte %zu of %zu: word %08x vs %08x", i,
                a.size(), wa, wb);
  return text;
}

TEST(GpuQ4, PayloadsAndResidualsEqualTheCpuByteForByte) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  for (DType dtype : kDtypes) {
    for (int64_t n : testing::edge_lengths()) {
      for (bool stochastic : {true, false}) {
        HostTensor x =
            HostTensor::from_floats(dtype, testing::normal_floats(n, static_cast<uint32_t>(n)));
        std::vector<float> r = testing::normal_floats(n, 3, 0.1f);
        if (n > 70) x.set(70, std::nanf(""));
        auto ref = testing::q4_encode_tensor(x, 64, stochastic, {5, 6, 7, 8, 1}, r, true);
        DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dr(r.data(), r.size() * 4),
            dout(r.size() * 4 + 16), dp(ref.payload.size());
        Segment seg{dx.get(), 0, n};
        Q4EncodeParams p;
        p.segments = &seg;
        p.num_segments = 1;
        p.dtype = testing::code(dtype);
        p.numel = n;
        p.residual_in = dr.get();
        p.residual_out = dout.get();
        p.stochastic = stochastic;
        p.rng = {5, 6, 7, 8, 1};
        p.payload = dp.get();
        backend->q4_encode(p);
        ASSERT_EQ(dp.host(), ref.payload)
            << dtype_name(dtype) << " n=" << n << " " << first_difference(dp.host(), ref.payload);
        auto res = dout.host();
        ASSERT_EQ(std::memcmp(res.data(), ref.residual.data(), n * 4), 0)
            << dtype_name(dtype) << " n=" << n;

        // Decode of two payloads summed and averaged equals the CPU's, in every output dtype.
        HostTensor cpu_out =
            testing::q4_decode_payloads({&ref.payload, &ref.payload}, n, 64, dtype, 2.0f);
        DeviceBuffer dy(x.bytes.size());
        Segment oseg{dy.get(), 0, n};
        const uint8_t* ptrs[2] = {dp.get(), dp.get()};
        Q4DecodeParams d;
        d.payloads = ptrs;
        d.num_payloads = 2;
        d.payload_bytes = ref.payload.size();
        d.numel = n;
        d.segments = &oseg;
        d.num_segments = 1;
        d.dtype = testing::code(dtype);
        d.divisor = 2.0f;
        backend->q4_decode(d);
        EXPECT_EQ(backend->take_decode_status(), n > 70);
        ASSERT_EQ(dy.host(), cpu_out.bytes)
            << dtype_name(dtype) << " n=" << n << " " << first_difference(dy.host(), cpu_out.bytes);
      }
    }
  }
}

// The device scan flags the values the CPU scan flags (the hierarchical allreduce's gathered
// bucket), in a segment table of two dtypes' worth of sizes.
TEST(GpuScan, NonFiniteScanFlagsWhatTheCpuScanFlags) {
  SKIP_WITHOUT_GPU();
  auto gpu = cuda::make_cuda_backend();
  auto cpu = make_cpu_backend();
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (float bad : {0.0f, NAN, -INFINITY}) {
      HostTensor a = HostTensor::from_floats(dtype, testing::normal_floats(300, 1));
      HostTensor b = HostTensor::from_floats(dtype, testing::normal_floats(70001, 2));
      if (bad != 0.0f) b.set(70000, bad);
      DeviceBuffer da(a.bytes.data(), a.bytes.size()), db(b.bytes.data(), b.bytes.size());
      Segment host_segs[2] = {a.segment(), b.segment()};
      Segment dev_segs[2] = {Segment{da.get(), 0, 300}, Segment{db.get(), 300, 70001}};
      host_segs[1].offset = 300;
      for (int device = 0; device < 2; ++device) {
        NonfiniteScanParams p;
        p.segments = device ? dev_segs : host_segs;
        p.num_segments = 2;
        p.dtype = static_cast<uint8_t>(dtype);
        p.numel = 70301;
        Backend& backend = device ? *gpu : *cpu;
        backend.scan_nonfinite(p);
        EXPECT_EQ(backend.take_decode_status(), bad != 0.0f)
            << (device ? "cuda " : "cpu ") << dtype_name(dtype) << " " << bad;
      }
    }
  }
}

TEST(GpuQ4, FusedPackingEqualsUnfused) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  std::mt19937 gen(1);
  std::vector<std::unique_ptr<DeviceBuffer>> tensors;
  std::vector<Segment> segs;
  std::vector<float> flat;
  int64_t off = 0;
  for (int t = 0; t < 100; ++t) {
    const int64_t n = 1 + gen() % 5000;
    auto v = testing::normal_floats(n, t);
    tensors.push_back(std::make_unique<DeviceBuffer>(v.data(), n * 4));
    segs.push_back(Segment{tensors.back()->get(), off, n});
    flat.insert(flat.end(), v.begin(), v.end());
    off += n;
  }
  DeviceBuffer dflat(flat.data(), flat.size() * 4);
  Segment whole{dflat.get(), 0, off};
  const size_t bytes = q4_payload_bytes(off, 64);
  DeviceBuffer a(bytes), b(bytes);
  Q4EncodeParams p;
  p.segments = segs.data();
  p.num_segments = 100;
  p.numel = off;
  p.rng = {1, 2, 3, 4, 0};
  p.payload = a.get();
  backend->q4_encode(p);
  p.segments = &whole;
  p.num_segments = 1;
  p.payload = b.get();
  backend->q4_encode(p);
  EXPECT_EQ(a.host(), b.host());
  HostTensor hx = HostTensor::from_floats(DType::kFloat32, flat);
  EXPECT_EQ(a.host(), testing::q4_encode_tensor(hx, 64, true, {1, 2, 3, 4, 0}).payload);
}

// Format v2: a flipped bit in the sections fails the body checksum summed on the device, and
// check_payloads refuses a bad chunk among chunks of differing sizes before anything is decoded.
TEST(GpuQ4, CorruptSectionsAreRejectedByTheBodyChecksumOnTheDevice) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(1000, 2));
  auto good = testing::q4_encode_tensor(x, 64, true, {1, 0, 0, 0, 0});
  auto bad = good;
  bad.payload[bad.payload.size() - 40] ^= 0x10;  // a code nibble
  DeviceBuffer dgood(good.payload.data(), good.payload.size()),
      dbad(bad.payload.data(), bad.payload.size());
  std::vector<float> sentinel(1000, 42.0f);
  DeviceBuffer dy(sentinel.data(), 4000);
  Segment seg{dy.get(), 0, 1000};
  const uint8_t* ptrs[2] = {dgood.get(), dbad.get()};
  Q4DecodeParams d;
  d.payloads = ptrs;
  d.num_payloads = 2;
  d.payload_bytes = good.payload.size();
  d.numel = 1000;
  d.segments = &seg;
  d.num_segments = 1;
  backend->q4_decode(d);
  try {
    backend->take_decode_status();
    ADD_FAILURE() << "a corrupted body was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("body checksum"), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::memcmp(dy.host().data(), sentinel.data(), 4000), 0);
  const int64_t numel[2] = {1000, 1000};
  PayloadCheckParams c;
  c.payloads = ptrs;
  c.num_payloads = 2;
  c.payload_bytes = good.payload.size();
  c.numel = numel;
  backend->check_payloads(c);
  EXPECT_THROW(backend->take_decode_status(), Error);
  ptrs[1] = dgood.get();
  backend->check_payloads(c);
  EXPECT_FALSE(backend->take_decode_status());
}

TEST(GpuQ4, CorruptHeaderIsRejectedAndOutputUntouched) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(1000, 1));
  auto enc = testing::q4_encode_tensor(x, 64, true, {1, 0, 0, 0, 0});
  enc.payload[20] ^= 1;
  DeviceBuffer dp(enc.payload.data(), enc.payload.size());
  std::vector<float> sentinel(1000, 42.0f);
  DeviceBuffer dy(sentinel.data(), 4000);
  Segment seg{dy.get(), 0, 1000};
  const uint8_t* ptr = dp.get();
  Q4DecodeParams d;
  d.payloads = &ptr;
  d.num_payloads = 1;
  d.payload_bytes = enc.payload.size();
  d.numel = 1000;
  d.segments = &seg;
  d.num_segments = 1;
  // Decodes are queued; the rejection is reported at the next status check.
  backend->q4_decode(d);
  EXPECT_THROW(backend->take_decode_status(), Error);
  auto out = dy.host();
  EXPECT_EQ(std::memcmp(out.data(), sentinel.data(), 4000), 0);
}

TEST(GpuTopK, PayloadsAndResidualsEqualTheCpuByteForByte) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  for (DType dtype : kDtypes) {
    for (int64_t n : testing::edge_lengths()) {
      for (bool exact : {true, false}) {
        for (DType vd : {DType::kFloat32, DType::kBFloat16}) {
          HostTensor x = HostTensor::from_floats(
              dtype, testing::normal_floats(n, static_cast<uint32_t>(n) + 1));
          std::vector<float> r = testing::normal_floats(n, 4, 0.1f);
          TopKOptions o;
          o.exact = exact;
          const int64_t k = topk_k(n, o.ratio), cap = topk_capacity(n, o);
          auto ref = testing::topk_encode_tensor(x, k, cap, exact, vd, r);
          DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dr(r.data(), n * 4), dout(n * 4 + 16),
              dp(ref.payload.size()), ws(backend->topk_workspace_bytes(n));
          Segment seg{dx.get(), 0, n};
          TopKEncodeParams p;
          p.segments = &seg;
          p.num_segments = 1;
          p.dtype = testing::code(dtype);
          p.numel = n;
          p.residual_in = dr.get();
          p.residual_out = dout.get();
          p.k = k;
          p.capacity = static_cast<uint32_t>(cap);
          p.exact = exact;
          p.value_dtype = testing::code(vd);
          p.payload = dp.get();
          p.workspace = ws.get();
          backend->topk_encode(p);
          ASSERT_EQ(dp.host(), ref.payload) << dtype_name(dtype) << " n=" << n << " exact=" << exact
                                            << " " << first_difference(dp.host(), ref.payload);
          auto res = dout.host();
          ASSERT_EQ(std::memcmp(res.data(), ref.residual.data(), n * 4), 0);

          HostTensor cpu_out(dtype, n);
          Segment cseg = cpu_out.segment();
          std::vector<const uint8_t*> cptrs = {ref.payload.data(), ref.payload.data(),
                                               ref.payload.data()};
          cpu::topk_decode(testing::topk_decode_params(cptrs, ref.payload.size(), n, cap, vd, &cseg,
                                                       dtype, 3.0f));
          DeviceBuffer dy(x.bytes.size());
          Segment oseg{dy.get(), 0, n};
          std::vector<const uint8_t*> gptrs = {dp.get(), dp.get(), dp.get()};
          TopKDecodeParams d = testing::topk_decode_params(gptrs, ref.payload.size(), n, cap, vd,
                                                           &oseg, dtype, 3.0f);
          d.workspace = ws.get();
          backend->topk_decode(d);
          ASSERT_EQ(dy.host(), cpu_out.bytes) << first_difference(dy.host(), cpu_out.bytes);
        }
      }
    }
  }
}

// k = 0 is accepted by both backends (it used to be refused on the GPU only) and selects nothing.
TEST(GpuTopK, KZeroEqualsTheCpu) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{4099}}) {
    HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 6));
    if (n > 7) x.set(7, std::nanf(""));
    std::vector<float> r = testing::normal_floats(n, 5, 0.1f);
    auto ref = testing::topk_encode_tensor(x, 0, 0, true, DType::kFloat32, r);
    DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dr(r.data(), n * 4), dout(n * 4 + 16),
        dp(ref.payload.size()), ws(backend->topk_workspace_bytes(n));
    Segment seg{dx.get(), 0, n};
    TopKEncodeParams p;
    p.segments = &seg;
    p.num_segments = 1;
    p.numel = n;
    p.residual_in = dr.get();
    p.residual_out = dout.get();
    p.k = 0;
    p.capacity = 0;
    p.payload = dp.get();
    p.workspace = ws.get();
    backend->topk_encode(p);
    ASSERT_EQ(dp.host(), ref.payload)
        << "n=" << n << " " << first_difference(dp.host(), ref.payload);
    auto res = dout.host();
    ASSERT_EQ(std::memcmp(res.data(), ref.residual.data(), n * 4), 0) << "n=" << n;
  }
}

TEST(GpuTopK, OutOfRangeIndexIsRejectedOnTheDevice) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(2000, 1));
  auto enc = testing::topk_encode_tensor(x, 20, 20, true, DType::kFloat32);
  reinterpret_cast<uint32_t*>(enc.payload.data() + kPayloadHeaderBytes)[3] = 1u << 30;
  DeviceBuffer dp(enc.payload.data(), enc.payload.size()), ws(backend->topk_workspace_bytes(2000));
  std::vector<float> sentinel(2000, 42.0f);
  DeviceBuffer dy(sentinel.data(), 8000);
  Segment seg{dy.get(), 0, 2000};
  std::vector<const uint8_t*> ptrs = {dp.get()};
  TopKDecodeParams d = testing::topk_decode_params(ptrs, enc.payload.size(), 2000, 20,
                                                   DType::kFloat32, &seg, DType::kFloat32);
  d.workspace = ws.get();
  backend->topk_decode(d);
  EXPECT_THROW(backend->take_decode_status(), Error);
  auto out = dy.host();
  EXPECT_EQ(std::memcmp(out.data(), sentinel.data(), 8000), 0);
}

// ---- top-k, both kernel generations -------------------------------------------------------

std::unique_ptr<Backend> topk_backend(KernelGeneration g) {
  cuda::CudaBackendOptions o;
  o.kernels = g;
  return cuda::make_cuda_backend(o);
}

const KernelGeneration kGenerations[] = {KernelGeneration::kV1, KernelGeneration::kV2};

const char* gen_name(KernelGeneration g) {
  return g == KernelGeneration::kV2 ? "v2" : "v1";
}

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
  bool alias = false;     // residual_in == residual_out
  bool residual = true;   // error feedback
  float divisor = 3.0f;
  std::string name() const {
    return std::string(dtype_name(dtype)) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
           " cap=" + std::to_string(cap) + (exact ? " exact" : " approx") + " vd=" +
           dtype_name(vd) + " rd=" + dtype_name(rd) + (multi ? " multi" : "") +
           (alias ? " alias" : "") + (residual ? "" : " no-ef") +
           " div=" + std::to_string(divisor);
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
    hsegs.push_back(Segment{x.bytes.data() + cuts[i] * dtype_size(c.dtype), cuts[i],
                            cuts[i + 1] - cuts[i]});
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
      dout(r0.bytes.data(), r0.bytes.size()), dp(ref.size()),
      ws(backend.topk_workspace_bytes(n));
  std::vector<Segment> dsegs;
  for (size_t i = 0; i + 1 < cuts.size(); ++i)
    dsegs.push_back(Segment{dx.get() + cuts[i] * dtype_size(c.dtype), cuts[i],
                            cuts[i + 1] - cuts[i]});
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
    gout_segs.push_back(Segment{dy.get() + cuts[i] * dtype_size(c.dtype), cuts[i],
                                cuts[i + 1] - cuts[i]});
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
    auto backend = topk_backend(g);
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
    auto backend = topk_backend(g);
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
    auto backend = topk_backend(g);
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
    auto backend = topk_backend(g);
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

// A one-rank NCCL communicator and a stream, released at scope exit.
struct OneRankNccl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  OneRankNccl() {
    int dev = 0;
    GRADCOMP_NCCL_CHECK(ncclCommInitAll(&comm, 1, &dev));
    GRADCOMP_CUDA_CHECK(cudaStreamCreate(&stream));
  }
  ~OneRankNccl() {
    ncclCommDestroy(comm);
    cudaStreamDestroy(stream);
  }
};

// A configuration on the GPU (NCCL, one rank) and on the CPU (in-process, one rank; the same
// configuration unless given another).
struct EnginePair {
  NcclCommunicator nccl;
  std::unique_ptr<Backend> gpu;
  CompressedAllreduce gpu_engine;
  InProcessGroup group{1};
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  CompressedAllreduce cpu_engine;
  EnginePair(const OneRankNccl& rank, const CompressionConfig& c) : EnginePair(rank, c, c) {}
  EnginePair(const OneRankNccl& rank, const CompressionConfig& c, const CompressionConfig& on_cpu)
      : nccl(rank.comm, rank.stream),
        gpu(cuda::make_cuda_backend(cuda::CudaBackendOptions{0, rank.stream, 0})),
        gpu_engine(nccl, *gpu, c),
        cpu_engine(group.communicator(0), *cpu, on_cpu) {}
};

// Also q4 configured for pieces of 1000 elements: on the GPU a bucket goes in one piece (stream
// order, nothing to overlap), the same bytes as the CPU's one piece.
TEST(GpuCollectives, NcclEngineMatchesTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  OneRankNccl nccl_rank;
  for (int variant = 0; variant < 3; ++variant) {
    CompressionConfig c;
    c.codec = variant == 1 ? Codec::kTopK : Codec::kQ4;
    c.seed = 9;
    CompressionConfig on_cpu = c;
    if (variant == 2) {
      c.piece_numel = 1000;
      on_cpu.piece_numel = 0;
    }
    EnginePair engines(nccl_rank, c, on_cpu);
    CompressedAllreduce& gpu_engine = engines.gpu_engine;
    CompressedAllreduce& cpu_engine = engines.cpu_engine;
    for (int step = 0; step < 3; ++step) {
      HostTensor x = HostTensor::from_floats(DType::kBFloat16, testing::normal_floats(10007, step));
      DeviceBuffer dx(x.bytes.data(), x.bytes.size());
      Segment gseg{dx.get(), 0, x.numel}, cseg = x.segment();
      EXPECT_TRUE(gpu_engine.allreduce(&gseg, 1, DType::kBFloat16, 1));
      EXPECT_TRUE(cpu_engine.allreduce(&cseg, 1, DType::kBFloat16, 1));
      gpu_engine.advance_step();
      cpu_engine.advance_step();
      ASSERT_EQ(dx.host(), x.bytes) << "variant " << variant << " step " << step << " "
                                    << first_difference(dx.host(), x.bytes);
    }
  }
}

// The queued path (what the DDP hook uses on CUDA) gives the CPU engine's bytes, and a
// non-finite step keeps the residuals (and top-k velocities) on the device exactly as the CPU
// engine keeps them. Variant 2 runs DGC's remedies: clipping (the fixed-order norm on the
// device), momentum correction, masking and the warm-up's shrinking payloads; variant 3 the q4
// warm-up with momentum, switching to top-k at step 2 (own-chunk residuals released).
TEST(GpuCollectives, QueuedNcclEngineKeepsResidualsOnNonFiniteSteps) {
  SKIP_WITHOUT_GPU();
  OneRankNccl nccl_rank;
  for (int variant = 0; variant < 4; ++variant) {
    CompressionConfig c;
    c.codec = variant == 0 ? Codec::kQ4 : Codec::kTopK;
    c.seed = 11;
    if (variant == 2) {
      c.remedies.momentum = 0.9f;
      c.remedies.clip_norm = 20.0f;
      c.remedies.warmup_steps = 3;
    }
    if (variant == 3) {
      c.remedies.momentum = 0.9f;
      c.remedies.warmup = TopKWarmup::kQ4;
      c.remedies.warmup_steps = 2;
    }
    EnginePair engines(nccl_rank, c);
    CompressedAllreduce& gpu_engine = engines.gpu_engine;
    CompressedAllreduce& cpu_engine = engines.cpu_engine;
    uint64_t cpu_nonfinite = 0;
    for (int step = 0; step < 4; ++step) {
      auto v = testing::normal_floats(5003, 40 + step);
      if (step == 2) v[77] = std::numeric_limits<float>::quiet_NaN();
      HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
      DeviceBuffer dx(x.bytes.data(), x.bytes.size());
      Segment gseg{dx.get(), 0, x.numel}, cseg = x.segment();
      gpu_engine.enqueue_allreduce(&gseg, 1, DType::kFloat32, 3);
      if (!cpu_engine.allreduce(&cseg, 1, DType::kFloat32, 3)) ++cpu_nonfinite;
      gpu_engine.advance_step();
      cpu_engine.advance_step();
      ASSERT_EQ(dx.host(), x.bytes) << "variant " << variant << " step " << step << " "
                                    << first_difference(dx.host(), x.bytes);
    }
    EXPECT_EQ(cpu_nonfinite, 1u);
    // poll() never waits: its first call queues a snapshot, later calls return it once ready.
    uint64_t polled = 0;
    while (!gpu_engine.poll(&polled)) {
    }
    EXPECT_EQ(polled + gpu_engine.synchronize(), cpu_nonfinite);
    const CompressionState gs = gpu_engine.state(), cs = cpu_engine.state();
    EXPECT_EQ(gs.residuals, cs.residuals);
    EXPECT_EQ(gs.chunk_residuals, cs.chunk_residuals);
    EXPECT_EQ(gs.velocities, cs.velocities);
    EXPECT_EQ(gs.velocities.empty(), variant < 2);
  }
}

}  // namespace
}  // namespace gradcomp
