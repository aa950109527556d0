// The outer-sync tests' shared reference: the inner steps' drift and DiLoCo's outer Nesterov step.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gradcomp {
namespace testing {

// Inner "training" of rank r at step t: a deterministic drift of every element.
inline float drift(int rank, uint64_t t, size_t e) {
  return 0.01f * static_cast<float>((rank + 1) * ((e * 7 + t * 3) % 11)) - 0.04f;
}

// The outer Nesterov SGD step of one element, as outer_math.h rounds it. Writing each product to
// a volatile keeps the compiler from fusing it with the add.
inline float sgd_reference(float anchor, float g, float* buf, float lr, float mu) {
  volatile float p = *buf * mu;
  const float b = p + g;
  *buf = b;
  volatile float q = b * mu;
  const float update = g + q;
  volatile float r = update * lr;
  return anchor - r;
}

}  // namespace testing
}  // namespace gradcomp
