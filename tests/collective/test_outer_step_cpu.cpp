// DiLoCo's vectorized outer step loops write the bytes of the scalar rule, element by element.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

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

}  // namespace
}  // namespace gradcomp
