// The CPU q4 loops for each instruction set write the same bytes as the portable reference.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

// Restores the process-wide instruction set when a test ends.
class IsaGuard {
 public:
  IsaGuard() : saved_(cpu::active_isa()) {}
  ~IsaGuard() { cpu::set_active_isa(saved_); }

 private:
  cpu::Isa saved_;
};

std::vector<cpu::Isa> simd_isas() {
  std::vector<cpu::Isa> out;
  for (cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512})
    if (cpu::isa_supported(isa)) out.push_back(isa);
  return out;
}

// Gaussian values whose scale changes per 64 elements, with the blocks the loops treat apart:
// all zeros, NaN, +-Inf, denormals, signed zeros and values near FLT_MAX.
std::vector<float> awkward_values(int64_t n, uint32_t seed) {
  auto v = testing::normal_floats(n, seed);
  std::mt19937 gen(seed);
  for (int64_t i = 0; i < n; ++i) v[i] = std::ldexp(v[i], static_cast<int>((i / 64) % 13) - 6);
  for (int64_t b = 0; b * 64 < n; ++b) {
    const int64_t at = b * 64 + static_cast<int64_t>(gen() % 64);
    if (at >= n) continue;
    switch (b % 11) {
      case 1:
        for (int64_t i = b * 64; i < std::min(n, b * 64 + 64); ++i) v[i] = (i & 1) ? 0.0f : -0.0f;
        break;
      case 3:
        v[at] = std::numeric_limits<float>::quiet_NaN();
        break;
      case 5:
        v[at] = (b & 1) ? std::numeric_limits<float>::infinity()
                        : -std::numeric_limits<float>::infinity();
        break;
      case 7:
        for (int64_t i = b * 64; i < std::min(n, b * 64 + 64); ++i) v[i] = v[i] * 1e-40f;
        break;
      case 9:
        v[at] = (b & 2) ? 3.0e38f : -3.4e38f;
        break;
      default:
        break;
    }
  }
  return v;
}

struct EncodeCase {
  DType dtype;
  DType residual_dtype;
  bool residual_in;
  bool residual_out;
  bool stochastic;
  int block;
};

struct EncodeResult {
  std::vector<uint8_t> payload;
  std::vector<uint8_t> residual;
  bool operator==(const EncodeResult& o) const {
    return payload == o.payload && residual == o.residual;
  }
};

EncodeResult encode(HostTensor& x, const HostTensor& residual, const EncodeCase& c,
                    math::RngKey key, int threads) {
  EncodeResult out;
  out.payload.assign(q4_payload_bytes(x.numel, c.block), 0xAB);
  out.residual.assign(residual.bytes.size(), 0xCD);
  Segment seg = x.segment();
  Q4EncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.dtype = testing::code(x.dtype);
  p.numel = x.numel;
  p.block_size = static_cast<uint32_t>(c.block);
  p.stochastic = c.stochastic;
  p.rng = key;
  p.payload = out.payload.data();
  p.residual_dtype = testing::code(c.residual_dtype);
  if (c.residual_in) p.residual_in = residual.bytes.data();
  if (c.residual_out) p.residual_out = out.residual.data();
  cpu::q4_encode(p, threads);
  return out;
}

TEST(CpuIsa, PortableIsAlwaysSupportedAndSelectable) {
  IsaGuard guard;
  EXPECT_TRUE(cpu::isa_supported(cpu::Isa::kPortable));
  cpu::set_active_isa(cpu::Isa::kPortable);
  EXPECT_EQ(cpu::active_isa(), cpu::Isa::kPortable);
  for (cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (!cpu::isa_supported(isa)) EXPECT_THROW(cpu::set_active_isa(isa), Error);
  }
}

TEST(CpuIsa, Q4EncodeEqualsPortableByteForByte) {
  const auto isas = simd_isas();
  if (isas.empty()) GTEST_SKIP() << "this CPU has no SIMD loops to compare (no AVX2)";
  IsaGuard guard;
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  int cases = 0;
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{13}, int64_t{63}, int64_t{64}, int64_t{65},
                    int64_t{255}, int64_t{256}, int64_t{257}, int64_t{4099}, int64_t{3 * 4096 + 17},
                    int64_t{(1 << 20) + 3}}) {
    for (DType dtype : dtypes) {
      HostTensor x = HostTensor::from_floats(dtype, awkward_values(n, static_cast<uint32_t>(n)));
      for (DType rdtype : {DType::kFloat32, DType::kBFloat16}) {
        HostTensor residual = HostTensor::from_floats(rdtype, testing::normal_floats(n, 99, 0.25f));
        for (int block : {16, 64, 256}) {
          for (int mode = 0; mode < 8; ++mode) {
            // Large inputs only in the configurations users run most.
            if (n > 70000 && (block != 64 || rdtype != DType::kFloat32 || mode % 3 != 0)) continue;
            const EncodeCase c{dtype,           rdtype,          (mode & 1) != 0,
                               (mode & 2) != 0, (mode & 4) == 0, block};
            const math::RngKey key{0x1234567890ull + static_cast<uint64_t>(n), 7, 3,
                                   static_cast<uint32_t>(mode), 1};
            cpu::set_active_isa(cpu::Isa::kPortable);
            const EncodeResult ref = encode(x, residual, c, key, 1);
            for (cpu::Isa isa : isas) {
              cpu::set_active_isa(isa);
              ASSERT_TRUE(encode(x, residual, c, key, 2) == ref)
                  << cpu::isa_name(isa) << " n=" << n << " dtype=" << dtype_name(dtype)
                  << " residual=" << dtype_name(rdtype) << " block=" << block << " mode=" << mode;
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 500);
}

// Random groups are numbered by absolute element index; near 2^35 elements the group counter's
// low word wraps and the vector lanes must carry into the high word. Segment offsets place the
// range there without allocating it.
TEST(CpuIsa, RandomCounterCarryNearTwoToThe35) {
  const auto isas = simd_isas();
  if (isas.empty()) GTEST_SKIP() << "this CPU has no SIMD loops to compare (no AVX2)";
  IsaGuard guard;
  const int64_t n = 8192;
  auto v = testing::normal_floats(n, 5);
  const int64_t first = (int64_t{1} << 35) - 4096;  // group 2^32 - 512: the wrap is mid-chunk
  Segment seg{v.data(), first, n};
  std::vector<uint8_t> ref(q4_payload_bytes(n, 64)), got(ref.size());
  Q4EncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.begin = first;
  p.numel = n;
  p.rng = {42, 1, 2, 3, 0};
  p.payload = ref.data();
  cpu::set_active_isa(cpu::Isa::kPortable);
  cpu::q4_encode(p);
  for (cpu::Isa isa : isas) {
    cpu::set_active_isa(isa);
    p.payload = got.data();
    cpu::q4_encode(p);
    EXPECT_EQ(got, ref) << cpu::isa_name(isa);
  }
}

TEST(CpuIsa, AliasedResidualEqualsSeparateBuffers) {
  const auto isas = simd_isas();
  if (isas.empty()) GTEST_SKIP() << "this CPU has no SIMD loops to compare (no AVX2)";
  IsaGuard guard;
  const int64_t n = 10000;
  HostTensor x = HostTensor::from_floats(DType::kFloat32, awkward_values(n, 3));
  for (cpu::Isa isa : isas) {
    cpu::set_active_isa(isa);
    auto r = testing::normal_floats(n, 4, 0.1f);
    const EncodeCase c{DType::kFloat32, DType::kFloat32, true, true, true, 64};
    HostTensor residual = HostTensor::from_floats(DType::kFloat32, r);
    const EncodeResult separate = encode(x, residual, c, {1, 2, 3, 4, 0}, 1);
    std::vector<uint8_t> payload(separate.payload.size());
    Segment seg = x.segment();
    Q4EncodeParams p;
    p.segments = &seg;
    p.num_segments = 1;
    p.numel = n;
    p.rng = {1, 2, 3, 4, 0};
    p.payload = payload.data();
    p.residual_in = r.data();
    p.residual_out = r.data();
    cpu::q4_encode(p);
    EXPECT_EQ(payload, separate.payload) << cpu::isa_name(isa);
    std::vector<uint8_t> in_place(n * 4);
    std::memcpy(in_place.data(), r.data(), in_place.size());
    EXPECT_EQ(in_place, separate.residual) << cpu::isa_name(isa);
  }
}

TEST(CpuIsa, Q4DecodeEqualsPortableByteForByte) {
  const auto isas = simd_isas();
  if (isas.empty()) GTEST_SKIP() << "this CPU has no SIMD loops to compare (no AVX2)";
  IsaGuard guard;
  for (int64_t n : {int64_t{1}, int64_t{13}, int64_t{65}, int64_t{257}, int64_t{4099},
                    int64_t{3 * 4096 + 17}, int64_t{(1 << 20) + 3}}) {
    for (int block : {16, 64, 256}) {
      std::vector<std::vector<uint8_t>> payloads;
      for (int w = 0; w < 3; ++w) {
        HostTensor x = HostTensor::from_floats(DType::kFloat32,
                                               awkward_values(n, static_cast<uint32_t>(n * 3 + w)));
        cpu::set_active_isa(cpu::Isa::kPortable);
        payloads.push_back(
            testing::q4_encode_tensor(x, block, true, {1, 2, 3, static_cast<uint32_t>(w), 0})
                .payload);
      }
      for (DType out : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        for (int world : {1, 3}) {
          std::vector<const std::vector<uint8_t>*> ptrs;
          for (int w = 0; w < world; ++w) ptrs.push_back(&payloads[w]);
          cpu::set_active_isa(cpu::Isa::kPortable);
          const HostTensor ref =
              testing::q4_decode_payloads(ptrs, n, block, out, static_cast<float>(world));
          for (cpu::Isa isa : isas) {
            cpu::set_active_isa(isa);
            const HostTensor got =
                testing::q4_decode_payloads(ptrs, n, block, out, static_cast<float>(world));
            ASSERT_EQ(got.bytes, ref.bytes)
                << cpu::isa_name(isa) << " n=" << n << " block=" << block
                << " out=" << dtype_name(out) << " W=" << world;
          }
        }
      }
    }
  }
}

TEST(CpuIsa, DecodeReportsNonFiniteUnderEveryIsa) {
  IsaGuard guard;
  std::vector<cpu::Isa> isas = simd_isas();
  isas.push_back(cpu::Isa::kPortable);
  for (int64_t at : {int64_t{5}, int64_t{4096 + 2}, int64_t{4099 - 1}}) {
    std::vector<float> v = testing::normal_floats(4099, 1);
    v[at] = std::numeric_limits<float>::infinity();
    HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
    auto enc = testing::q4_encode_tensor(x, 64, true, {1, 1, 1, 1, 0});
    for (cpu::Isa isa : isas) {
      cpu::set_active_isa(isa);
      HostTensor out(DType::kFloat32, x.numel);
      Segment seg = out.segment();
      const uint8_t* ptr = enc.payload.data();
      Q4DecodeParams d;
      d.payloads = &ptr;
      d.num_payloads = 1;
      d.payload_bytes = enc.payload.size();
      d.numel = x.numel;
      d.segments = &seg;
      d.num_segments = 1;
      uint32_t nonfinite = 0;
      d.nonfinite = &nonfinite;
      cpu::q4_decode(d);
      EXPECT_EQ(nonfinite, 1u) << cpu::isa_name(isa) << " Inf at " << at;
      EXPECT_TRUE(std::isnan(out.get(at)));
    }
  }
}

}  // namespace
}  // namespace gradcomp
