// DiLoCo's vectorized outer step loops write the bytes of the scalar rule, element by element.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gradcomp/backend.h"
#include "gradcomp/cpu.h"
#include "math/outer_math.h"
#include "outer_step_cpu.h"

namespace gradcomp {
namespace {

// One element at a time, out of line, so that no loop around it is vectorized: the scalar rule.
__attribute__((noinline)) float scalar_sgd(float anchor, float g, float* buf, float lr, float mu,
                                           bool nesterov) {
  return math::outer_sgd(anchor, g, buf, lr, mu, nesterov);
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Ordinary values with specials mixed in: NaN, infinities, signed zeros, subnormals, extremes.
std::vector<float> values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            0.0f,
                            -0.0f,
                            std::numeric_limits<float>::denorm_min(),
                            -1e-39f,
                            std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max()};
  std::vector<float> v(n);
  for (size_t e = 0; e < n; ++e)
    v[e] = rng() % 13 == 0 ? specials[rng() % (sizeof(specials) / sizeof(float))] : normal(rng);
  return v;
}

TEST(OuterStepCpu, EveryLoopWritesTheScalarRulesBytes) {
  std::vector<cpu::Isa> isas = {cpu::Isa::kPortable};
  for (cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512})
    if (cpu::isa_supported(isa)) isas.push_back(isa);
  int compared = 0;
  for (cpu::Isa isa : isas)
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{31},
                     size_t{1000}, size_t{4099}})
      for (bool nesterov : {true, false})
        for (float mu : {0.9f, 0.3f, 0.0f}) {
          if (nesterov && mu == 0.0f) continue;
          const uint32_t seed = static_cast<uint32_t>(n * 31 + (nesterov ? 7 : 0));
          std::vector<float> anchor = values(n, seed), g = values(n, seed + 1),
                             buf = values(n, seed + 2);
          std::vector<float> want_anchor = anchor, want_buf = buf;
          for (size_t e = 0; e < n; ++e)
            want_anchor[e] = scalar_sgd(want_anchor[e], g[e], &want_buf[e], 0.7f, mu, nesterov);
          detail::OuterStepRows rows;
          rows.anchor = anchor.data();
          rows.gradient = g.data();
          rows.momentum = buf.data();
          rows.n = n;
          rows.lr = 0.7f;
          rows.mu = mu;
          rows.nesterov = nesterov;
          detail::outer_sgd_rows(rows, isa);
          for (size_t e = 0; e < n; ++e) {
            ASSERT_EQ(bits(anchor[e]), bits(want_anchor[e]))
                << cpu::isa_name(isa) << " n " << n << " element " << e;
            ASSERT_EQ(bits(buf[e]), bits(want_buf[e]))
                << cpu::isa_name(isa) << " n " << n << " element " << e;
          }
          compared += static_cast<int>(n);
        }
  EXPECT_GT(compared, 0);
  // A non-finite result comes out as the one canonical NaN, as the CUDA backend writes it:
  // buf = 0.9 * -inf + inf.
  float anchor = 1.0f, g = std::numeric_limits<float>::infinity();
  float buf = -std::numeric_limits<float>::infinity();
  detail::OuterStepRows one;
  one.anchor = &anchor;
  one.gradient = &g;
  one.momentum = &buf;
  one.n = 1;
  one.lr = 0.7f;
  one.mu = 0.9f;
  detail::outer_sgd_rows(one, isas.back());
  EXPECT_EQ(bits(buf), math::kCanonicalNanBits);
  EXPECT_EQ(bits(anchor), math::kCanonicalNanBits);
}

// The CPU backend's outer operations (cpu_outer.cpp) over a fragment of fp32, fp16 and bf16
// tensors, against math::outer_* applied element by element here.
struct MixedFragment {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<OuterTensor> tensors;
  int64_t numel = 0;
  MixedFragment() {
    const std::pair<uint8_t, int64_t> shape[] = {
        {math::kDtypeF32, 9}, {math::kDtypeF16, 31}, {math::kDtypeBF16, 100}};
    uint32_t seed = 70;
    for (const auto& [dtype, n] : shape) {
      const std::vector<float> v = values(static_cast<size_t>(n), seed++);
      bytes.emplace_back(static_cast<size_t>(n) * math::dtype_bytes(dtype));
      for (int64_t e = 0; e < n; ++e) math::store_from_float(bytes.back().data(), e, dtype, v[e]);
      tensors.push_back({nullptr, n, numel, dtype});
      numel += n;
    }
    for (size_t i = 0; i < bytes.size(); ++i) tensors[i].data = bytes[i].data();
  }
  float at(int64_t k) const {  // element k of the fragment as fp32
    for (const OuterTensor& t : tensors)
      if (k < t.offset + t.numel) return math::load_as_float(t.data, k - t.offset, t.dtype);
    return 0.0f;
  }
  uint8_t dtype_at(int64_t k) const {
    for (const OuterTensor& t : tensors)
      if (k < t.offset + t.numel) return t.dtype;
    return 0;
  }
};

float rounded(float v, uint8_t dtype) {
  uint8_t b[4];
  math::store_from_float(b, 0, dtype, v);
  return math::load_as_float(b, 0, dtype);
}

TEST(OuterStepCpu, BackendOperationsApplyTheElementRulesAcrossDtypes) {
  auto backend = make_cpu_backend();
  MixedFragment f;
  const size_t n = static_cast<size_t>(f.numel);
  const std::vector<float> anchor = values(n, 1), mean = values(n, 2), buf = values(n, 3);
  std::vector<float> g(n), widened(n);
  OuterGradientParams gp;
  gp.tensors = f.tensors.data();
  gp.num_tensors = 3;
  gp.numel = f.numel;
  gp.gradient = widened.data();
  backend->outer_gradient(gp);  // no anchor: the parameters widened
  gp.anchor = anchor.data();
  gp.gradient = g.data();
  backend->outer_gradient(gp);
  for (size_t k = 0; k < n; ++k) {
    EXPECT_EQ(bits(widened[k]), bits(f.at(static_cast<int64_t>(k)))) << k;
    EXPECT_EQ(bits(g[k]), bits(math::outer_gradient(anchor[k], f.at(static_cast<int64_t>(k)))))
        << k;
  }
  // The eager step: into another array, the buffer left alone, the anchor stored.
  std::vector<float> a = anchor, m = buf, eager(n);
  OuterStepParams sp;
  sp.anchor = a.data();
  sp.gradient = mean.data();
  sp.momentum = m.data();
  sp.anchor_out = eager.data();
  sp.numel = f.numel;
  sp.lr = 0.7f;
  sp.mu = 0.9f;
  sp.tensors = f.tensors.data();
  sp.num_tensors = 3;
  backend->outer_step(sp);
  for (size_t k = 0; k < n; ++k) {
    float b = buf[k];
    const float want = math::outer_sgd(anchor[k], mean[k], &b, 0.7f, 0.9f, true);
    EXPECT_EQ(bits(eager[k]), bits(want)) << k;
    EXPECT_EQ(bits(m[k]), bits(buf[k])) << k;
    const uint8_t dt = f.dtype_at(static_cast<int64_t>(k));
    EXPECT_EQ(bits(f.at(static_cast<int64_t>(k))), bits(rounded(want, dt))) << k;
  }
  // In place with the buffer kept, no store; then each merge.
  sp.anchor_out = a.data();
  sp.momentum_out = m.data();
  sp.tensors = nullptr;
  sp.num_tensors = 0;
  sp.nesterov = false;
  backend->outer_step(sp);
  for (size_t k = 0; k < n; ++k) {
    float b = buf[k];
    EXPECT_EQ(bits(a[k]), bits(math::outer_sgd(anchor[k], mean[k], &b, 0.7f, 0.9f, false))) << k;
    EXPECT_EQ(bits(m[k]), bits(b)) << k;
  }
  for (OuterMerge mode : {OuterMerge::kMix, OuterMerge::kEagerCorrect, OuterMerge::kStore}) {
    std::vector<float> before(n);
    for (size_t k = 0; k < n; ++k) before[k] = f.at(static_cast<int64_t>(k));
    OuterMergeParams mp;
    mp.tensors = f.tensors.data();
    mp.num_tensors = 3;
    mp.numel = f.numel;
    mp.global = a.data();
    mp.eager = eager.data();
    mp.alpha = 0.25f;
    mp.mode = mode;
    backend->outer_merge(mp);
    for (size_t k = 0; k < n; ++k) {
      const float want = mode == OuterMerge::kMix ? math::outer_mix(before[k], a[k], 0.25f)
                         : mode == OuterMerge::kEagerCorrect
                             ? math::outer_eager_correct(before[k], a[k], eager[k])
                             : a[k];
      EXPECT_EQ(bits(f.at(static_cast<int64_t>(k))),
                bits(rounded(want, f.dtype_at(static_cast<int64_t>(k)))))
          << "mode " << int(mode) << " element " << k;
    }
  }
}

TEST(OuterStepCpu, BackendOperationsRefuseBadFragmentsByNameAndWriteNothing) {
  auto backend = make_cpu_backend();
  MixedFragment f;
  std::vector<float> g(static_cast<size_t>(f.numel), 5.0f);
  OuterGradientParams gp;
  gp.tensors = f.tensors.data();
  gp.num_tensors = 3;
  gp.numel = f.numel;
  gp.gradient = g.data();
  f.tensors[1].offset += 1;  // a gap between the tensors
  EXPECT_THROW(
      {
        try {
          backend->outer_gradient(gp);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("DiLoCo outer gradient: the tensors do not tile"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  for (float v : g) EXPECT_EQ(v, 5.0f);
  f.tensors[1].offset -= 1;
  OuterMergeParams mp;
  mp.tensors = f.tensors.data();
  mp.num_tensors = 3;
  mp.numel = f.numel;
  mp.global = g.data();
  mp.mode = OuterMerge::kEagerCorrect;  // without the eager anchor
  EXPECT_THROW(backend->outer_merge(mp), Error);
  OuterStepParams sp;
  sp.anchor = g.data();
  sp.gradient = g.data();
  sp.momentum = g.data();
  sp.anchor_out = g.data();  // the output is the gradient
  sp.numel = f.numel;
  EXPECT_THROW(backend->outer_step(sp), Error);
}

}  // namespace
}  // namespace gradcomp
