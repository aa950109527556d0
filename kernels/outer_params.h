// DiLoCo's outer step as backend operations: params of the outer gradient, step and merge.
#pragma once

#include <stdint.h>

#include "math/half.h"

namespace gradcomp {

// One parameter tensor of a DiLoCo fragment: `numel` elements of `dtype` (math::kDtype*) at
// `data` (backend memory), element `offset` of the fragment's fp32 buffers (anchor, momentum,
// outer gradient). A fragment's tensors tile [0, numel) in order.
struct OuterTensor {
  void* data = nullptr;
  int64_t numel = 0;
  int64_t offset = 0;
  uint8_t dtype = math::kDtypeF32;
};

// gradient[t.offset + e] = math::outer_gradient(anchor[t.offset + e], t.data[e]) for every
// tensor t of the fragment; with anchor null, the parameter widened to fp32 (how a fragment's
// first anchor is taken).
struct OuterGradientParams {
  const OuterTensor* tensors = nullptr;  // host array
  int num_tensors = 0;
  int64_t numel = 0;              // the fragment's
  const float* anchor = nullptr;  // backend memory, numel floats, or null
  float* gradient = nullptr;      // backend memory, numel floats
};

// The outer SGD step (math::outer_sgd) over a fragment: anchor_out[e] and momentum_out[e] from
// anchor[e], gradient[e] and momentum[e]. The outputs may be the inputs (in place) but must not
// overlap another array. momentum_out null: the buffer's new value is dropped (DiLoCo's eager
// step, which moves only this rank's parameters). With tensors, the new anchor is also stored
// into them, rounded to their dtypes.
struct OuterStepParams {
  const float* anchor = nullptr;  // backend memory, numel floats each
  const float* gradient = nullptr;
  const float* momentum = nullptr;
  float* anchor_out = nullptr;
  float* momentum_out = nullptr;
  int64_t numel = 0;
  float lr = 0.0f, mu = 0.0f;
  bool nesterov = true;
  const OuterTensor* tensors = nullptr;  // host array; null with num_tensors 0: no store
  int num_tensors = 0;
};

// What a merge writes into a fragment's tensors, from the new (global) anchor.
enum class OuterMerge : uint8_t {
  kStore = 0,         // param = global (the blocking sync, a non-finite round's reset)
  kMix = 1,           // param = math::outer_mix(param, global, alpha)
  kEagerCorrect = 2,  // param = math::outer_eager_correct(param, global, eager)
};

struct OuterMergeParams {
  const OuterTensor* tensors = nullptr;  // host array
  int num_tensors = 0;
  int64_t numel = 0;
  const float* global = nullptr;  // backend memory, numel floats
  const float* eager = nullptr;   // kEagerCorrect: the eager anchor, numel floats; else unused
  float alpha = 0.0f;             // kMix
  OuterMerge mode = OuterMerge::kStore;
};

// The rule a fragment's tensor table keeps, or null.
inline const char* outer_tensors_problem(const OuterTensor* tensors, int num_tensors,
                                         int64_t numel) {
  if (numel <= 0) return "the fragment has no elements";
  if (tensors == nullptr || num_tensors < 1) return "the fragment has no tensors";
  int64_t at = 0;
  for (int i = 0; i < num_tensors; ++i) {
    if (tensors[i].data == nullptr || tensors[i].numel <= 0) return "a tensor is empty or null";
    if (!math::dtype_valid(tensors[i].dtype))
      return "a tensor's dtype code is not float32, float16 or bfloat16";
    if (tensors[i].offset != at)
      return "the tensors do not tile the fragment in order (an offset is not the sum of the "
             "sizes before it)";
    at += tensors[i].numel;
  }
  if (at != numel) return "the tensors' sizes do not add up to the fragment's element count";
  return nullptr;
}

inline const char* params_problem(const OuterGradientParams& p) {
  if (p.gradient == nullptr) return "the gradient is null";
  return outer_tensors_problem(p.tensors, p.num_tensors, p.numel);
}

inline const char* params_problem(const OuterStepParams& p) {
  if (p.numel <= 0) return "the fragment has no elements";
  if (p.anchor == nullptr || p.gradient == nullptr || p.momentum == nullptr ||
      p.anchor_out == nullptr)
    return "anchor, gradient, momentum or anchor_out is null";
  if (p.gradient == p.anchor_out || p.gradient == p.momentum_out || p.anchor_out == p.momentum_out)
    return "an output is the gradient or the other output";
  if (p.num_tensors == 0 && p.tensors == nullptr) return nullptr;
  return outer_tensors_problem(p.tensors, p.num_tensors, p.numel);
}

inline const char* params_problem(const OuterMergeParams& p) {
  if (p.global == nullptr) return "the global anchor is null";
  if (p.mode != OuterMerge::kStore && p.mode != OuterMerge::kMix &&
      p.mode != OuterMerge::kEagerCorrect)
    return "the merge mode is not store, mix or eager-correct";
  if (p.mode == OuterMerge::kEagerCorrect && p.eager == nullptr)
    return "an eager-correct merge without the eager anchor";
  if (p.mode == OuterMerge::kMix && !(p.alpha >= 0.0f && p.alpha <= 1.0f))
    return "the mixing alpha is not in [0, 1]";
  return outer_tensors_problem(p.tensors, p.num_tensors, p.numel);
}

}  // namespace gradcomp
