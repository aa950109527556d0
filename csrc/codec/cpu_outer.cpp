// DiLoCo's outer step on the host: the reference of Backend::outer_gradient, outer_step, merge.
#include <cstring>
#include <vector>

#include "gradcomp/cpu.h"
#include "math/outer_math.h"
#include "outer_step_cpu.h"

namespace gradcomp {
namespace cpu {
namespace {

template <typename Params>
void check(const Params& p, const char* what) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem);
}

}  // namespace

void outer_gradient(const OuterGradientParams& p) {
  check(p, "DiLoCo outer gradient");
  for (int i = 0; i < p.num_tensors; ++i) {
    const OuterTensor& t = p.tensors[i];
    const float* anchor = p.anchor == nullptr ? nullptr : p.anchor + t.offset;
    float* g = p.gradient + t.offset;
    if (p.anchor == nullptr) {
      for (int64_t e = 0; e < t.numel; ++e) g[e] = math::load_as_float(t.data, e, t.dtype);
      continue;
    }
    for (int64_t e = 0; e < t.numel; ++e)
      g[e] = math::outer_gradient(anchor[e], math::load_as_float(t.data, e, t.dtype));
  }
}

void outer_step(const OuterStepParams& p) {
  check(p, "DiLoCo outer step");
  const size_t n = static_cast<size_t>(p.numel);
  if (p.momentum_out == nullptr) {
    // The eager step: the buffer's update is this rank's alone and is dropped.
    for (size_t e = 0; e < n; ++e) {
      float buf = p.momentum[e];
      p.anchor_out[e] = math::outer_sgd(p.anchor[e], p.gradient[e], &buf, p.lr, p.mu, p.nesterov);
    }
  } else {
    if (p.anchor_out != p.anchor) std::memmove(p.anchor_out, p.anchor, n * sizeof(float));
    if (p.momentum_out != p.momentum) std::memmove(p.momentum_out, p.momentum, n * sizeof(float));
    detail::OuterStepRows rows;
    rows.anchor = p.anchor_out;
    rows.gradient = p.gradient;
    rows.momentum = p.momentum_out;
    rows.n = n;
    rows.lr = p.lr;
    rows.mu = p.mu;
    rows.nesterov = p.nesterov;
    detail::outer_sgd_rows(rows);
  }
  for (int i = 0; i < p.num_tensors; ++i) {
    const OuterTensor& t = p.tensors[i];
    const float* anchor = p.anchor_out + t.offset;
    for (int64_t e = 0; e < t.numel; ++e) math::store_from_float(t.data, e, t.dtype, anchor[e]);
  }
}

void outer_merge(const OuterMergeParams& p) {
  check(p, "DiLoCo outer merge");
  for (int i = 0; i < p.num_tensors; ++i) {
    const OuterTensor& t = p.tensors[i];
    const float* global = p.global + t.offset;
    for (int64_t e = 0; e < t.numel; ++e) {
      float v = global[e];
      if (p.mode == OuterMerge::kMix) {
        v = math::outer_mix(math::load_as_float(t.data, e, t.dtype), v, p.alpha);
      } else if (p.mode == OuterMerge::kEagerCorrect) {
        v = math::outer_eager_correct(math::load_as_float(t.data, e, t.dtype), v,
                                      p.eager[t.offset + e]);
      }
      math::store_from_float(t.data, e, t.dtype, v);
    }
  }
}

}  // namespace cpu
}  // namespace gradcomp
