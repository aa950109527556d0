// DiLoCo's outer step v2 kernels: the outer gradient, the SGD step and the merge, per parameter
// tensor, 8 elements a thread in 16-byte accesses where aligned. Bytes equal cpu_outer.cpp's.
#include <cstdint>
#include <type_traits>

#include "math/outer_math.h"
#include "outer_params.h"
#include "v2/launchers_v2.h"
#include "v2/outer_v2_map.h"
#include "v2/span_io.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

constexpr int kOuterThreads = 256;
// A grid of this many blocks at most strides over the rest: enough to fill an H200 several times.
constexpr int64_t kOuterMaxBlocks = 4096;
// The step without a store into the parameters (a background round's step on copies).
constexpr uint8_t kNoStore = 3;

// One tensor's launch (or, without a store, the fragment's), every pointer already offset.
struct GradientArgs {
  const void* param;
  const float* anchor;  // unused when widening
  float* gradient;
  int64_t n;
};
struct StepArgs {
  const float* anchor;
  const float* gradient;
  const float* momentum;
  float* anchor_out;    // may be anchor
  float* momentum_out;  // may be momentum; unused without kKeep
  void* param;          // unused with kNoStore
  int64_t n;
  float lr, mu;
};
struct MergeArgs {
  void* param;
  const float* global;
  const float* eager;  // kEagerCorrect only
  int64_t n;
  float alpha;
};

// Every access to memory here (span_io.cuh's): the step writes its anchor and buffer in place,
// and a parameter's bits reach the outer gradient as the CPU's conversions give them.
constexpr Access kIo = Access::kInPlace;
static_assert(kOuterVec == kLaneElements, "span_io.cuh's 8-element accesses");

// ---- the outer gradient: gradient = anchor - param (or param, widening the first anchor) ----

template <uint8_t D, bool kWiden, bool kAligned>
__global__ void __launch_bounds__(kOuterThreads) outer_gradient_v2_kernel(const GradientArgs a) {
  const OuterThreadMap m =
      outer_thread_map(blockIdx.x, blockDim.x, threadIdx.x, gridDim.x, a.n, kAligned);
  // Not unrolled: a trip count would cost a 64-bit division.
#pragma unroll 1
  for (int64_t g = m.first_group; g < m.groups; g += m.stride) {
    const int64_t e = g * kOuterVec;
    float p[kOuterVec];
    load8_aligned<D, kIo>(static_cast<const char*>(a.param) + e * (D == math::kDtypeF32 ? 4 : 2),
                          p);
    if constexpr (!kWiden) {
      float an[kOuterVec];
      load8_aligned<math::kDtypeF32, kIo>(a.anchor + e, an);
#pragma unroll
      for (int j = 0; j < kOuterVec; ++j) p[j] = math::outer_gradient(an[j], p[j]);
    }
    store8_aligned<math::kDtypeF32, kIo>(a.gradient + e, p);
  }
#pragma unroll 1
  for (int64_t e = m.first_tail; e < a.n; e += m.stride) {
    const float p = load1<D, kIo>(a.param, e);
    a.gradient[e] = kWiden ? p : math::outer_gradient(a.anchor[e], p);
  }
}

// ---- the SGD step: new anchor and buffer (math::outer_sgd), the anchor stored unless kNoStore
// ----
template <uint8_t D, bool kNesterov, bool kKeep, bool kAligned>
__global__ void __launch_bounds__(kOuterThreads) outer_step_v2_kernel(const StepArgs a) {
  const OuterThreadMap m =
      outer_thread_map(blockIdx.x, blockDim.x, threadIdx.x, gridDim.x, a.n, kAligned);
  // Not unrolled: a trip count would cost a 64-bit division.
#pragma unroll 1
  for (int64_t g = m.first_group; g < m.groups; g += m.stride) {
    const int64_t e = g * kOuterVec;
    float an[kOuterVec], gr[kOuterVec], buf[kOuterVec];
    load8_aligned<math::kDtypeF32, kIo>(a.anchor + e, an);
    load8_aligned<math::kDtypeF32, kIo>(a.gradient + e, gr);
    load8_aligned<math::kDtypeF32, kIo>(a.momentum + e, buf);
#pragma unroll
    for (int j = 0; j < kOuterVec; ++j)
      an[j] = math::outer_sgd(an[j], gr[j], &buf[j], a.lr, a.mu, kNesterov);
    store8_aligned<math::kDtypeF32, kIo>(a.anchor_out + e, an);
    if constexpr (kKeep) store8_aligned<math::kDtypeF32, kIo>(a.momentum_out + e, buf);
    if constexpr (D != kNoStore)
      store8_aligned<D, kIo>(static_cast<char*>(a.param) + e * (D == math::kDtypeF32 ? 4 : 2), an);
  }
#pragma unroll 1
  for (int64_t e = m.first_tail; e < a.n; e += m.stride) {
    float buf = a.momentum[e];
    const float an = math::outer_sgd(a.anchor[e], a.gradient[e], &buf, a.lr, a.mu, kNesterov);
    a.anchor_out[e] = an;
    if constexpr (kKeep) a.momentum_out[e] = buf;
    if constexpr (D != kNoStore) store1<D, kIo>(a.param, e, an);
  }
}

// ---- the merge: param = global, outer_mix(param, global) or outer_eager_correct ----
template <uint8_t kMode>
__device__ __forceinline__ float merge_rule(float param, float global, float eager, float alpha) {
  if (kMode == static_cast<uint8_t>(OuterMerge::kMix)) return math::outer_mix(param, global, alpha);
  if (kMode == static_cast<uint8_t>(OuterMerge::kEagerCorrect))
    return math::outer_eager_correct(param, global, eager);
  return global;
}

template <uint8_t D, uint8_t kMode, bool kAligned>
__global__ void __launch_bounds__(kOuterThreads) outer_merge_v2_kernel(const MergeArgs a) {
  constexpr bool kReads = kMode != static_cast<uint8_t>(OuterMerge::kStore);
  constexpr bool kEager = kMode == static_cast<uint8_t>(OuterMerge::kEagerCorrect);
  const OuterThreadMap m =
      outer_thread_map(blockIdx.x, blockDim.x, threadIdx.x, gridDim.x, a.n, kAligned);
  // Not unrolled: a trip count would cost a 64-bit division.
#pragma unroll 1
  for (int64_t g = m.first_group; g < m.groups; g += m.stride) {
    const int64_t e = g * kOuterVec;
    void* at = static_cast<char*>(a.param) + e * (D == math::kDtypeF32 ? 4 : 2);
    float p[kOuterVec] = {}, gl[kOuterVec], ea[kOuterVec] = {};
    load8_aligned<math::kDtypeF32, kIo>(a.global + e, gl);
    if constexpr (kReads) load8_aligned<D, kIo>(at, p);
    if constexpr (kEager) load8_aligned<math::kDtypeF32, kIo>(a.eager + e, ea);
#pragma unroll
    for (int j = 0; j < kOuterVec; ++j) p[j] = merge_rule<kMode>(p[j], gl[j], ea[j], a.alpha);
    store8_aligned<D, kIo>(at, p);
  }
#pragma unroll 1
  for (int64_t e = m.first_tail; e < a.n; e += m.stride) {
    const float p = kReads ? load1<D, kIo>(a.param, e) : 0.0f;
    store1<D, kIo>(a.param, e,
                   merge_rule<kMode>(p, a.global[e], kEager ? a.eager[e] : 0.0f, a.alpha));
  }
}

// ---- dispatch on the host: run-time choices to template arguments ----
template <typename F>
void with_bool(bool b, F&& f) {
  if (b) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}
template <uint8_t V>
using U8 = std::integral_constant<uint8_t, V>;
template <typename F>
void with_dtype(uint8_t d, F&& f) {
  if (d == math::kDtypeF16) {
    f(U8<math::kDtypeF16>{});
  } else if (d == math::kDtypeBF16) {
    f(U8<math::kDtypeBF16>{});
  } else {
    f(U8<math::kDtypeF32>{});
  }
}

int grid_for(int64_t n) {
  const int64_t work = (n + kOuterVec - 1) / kOuterVec;
  const int64_t blocks = (work + kOuterThreads - 1) / kOuterThreads;
  return static_cast<int>(blocks < kOuterMaxBlocks ? (blocks < 1 ? 1 : blocks) : kOuterMaxBlocks);
}

// The CUDA kernels dereference parameters as their own type: each must be naturally aligned.
const char* tensors_problem(const OuterTensor* tensors, int count, int64_t numel) {
  if (const char* r = outer_tensors_problem(tensors, count, numel)) return r;
  for (int i = 0; i < count; ++i)
    if (reinterpret_cast<uintptr_t>(tensors[i].data) % math::dtype_bytes(tensors[i].dtype) != 0)
      return "a tensor's address is not aligned to its dtype";
  return nullptr;
}

LaunchStatus rejected(const char* why) {
  LaunchStatus s;
  s.rejected = why;
  return s;
}

}  // namespace

LaunchStatus run_outer_gradient(const OuterGradientParams& p, cudaStream_t stream) {
  if (const char* r = params_problem(p)) return rejected(r);
  if (const char* r = tensors_problem(p.tensors, p.num_tensors, p.numel)) return rejected(r);
  for (int i = 0; i < p.num_tensors; ++i) {
    const OuterTensor& t = p.tensors[i];
    GradientArgs a{t.data, p.anchor == nullptr ? nullptr : p.anchor + t.offset,
                   p.gradient + t.offset, t.numel};
    const bool aligned =
        aligned16(a.param) && aligned16(a.gradient) && (a.anchor == nullptr || aligned16(a.anchor));
    const int grid = grid_for(t.numel);
    with_dtype(t.dtype, [&](auto d) {
      with_bool(p.anchor == nullptr, [&](auto widen) {
        with_bool(aligned, [&](auto al) {
          outer_gradient_v2_kernel<decltype(d)::value, decltype(widen)::value, decltype(al)::value>
              <<<grid, kOuterThreads, 0, stream>>>(a);
        });
      });
    });
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return launched(err);
  }
  return launched(cudaSuccess);
}

LaunchStatus run_outer_step(const OuterStepParams& p, cudaStream_t stream) {
  if (const char* r = params_problem(p)) return rejected(r);
  if (p.num_tensors > 0) {
    if (const char* r = tensors_problem(p.tensors, p.num_tensors, p.numel)) return rejected(r);
  }
  // Without a store one launch covers the fragment; with one, a launch per tensor (its dtype).
  const int launches = p.num_tensors > 0 ? p.num_tensors : 1;
  for (int i = 0; i < launches; ++i) {
    const int64_t offset = p.num_tensors > 0 ? p.tensors[i].offset : 0;
    StepArgs a{p.anchor + offset,
               p.gradient + offset,
               p.momentum + offset,
               p.anchor_out + offset,
               p.momentum_out == nullptr ? nullptr : p.momentum_out + offset,
               p.num_tensors > 0 ? p.tensors[i].data : nullptr,
               p.num_tensors > 0 ? p.tensors[i].numel : p.numel,
               p.lr,
               p.mu};
    const bool aligned = aligned16(a.anchor) && aligned16(a.gradient) && aligned16(a.momentum) &&
                         aligned16(a.anchor_out) &&
                         (a.momentum_out == nullptr || aligned16(a.momentum_out)) &&
                         (a.param == nullptr || aligned16(a.param));
    const int grid = grid_for(a.n);
    auto launch = [&](auto d) {
      with_bool(p.nesterov, [&](auto nesterov) {
        with_bool(p.momentum_out != nullptr, [&](auto keep) {
          with_bool(aligned, [&](auto al) {
            outer_step_v2_kernel<decltype(d)::value, decltype(nesterov)::value,
                                 decltype(keep)::value, decltype(al)::value>
                <<<grid, kOuterThreads, 0, stream>>>(a);
          });
        });
      });
    };
    if (p.num_tensors > 0) {
      with_dtype(p.tensors[i].dtype, launch);
    } else {
      launch(U8<kNoStore>{});
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return launched(err);
  }
  return launched(cudaSuccess);
}

LaunchStatus run_outer_merge(const OuterMergeParams& p, cudaStream_t stream) {
  if (const char* r = params_problem(p)) return rejected(r);
  if (const char* r = tensors_problem(p.tensors, p.num_tensors, p.numel)) return rejected(r);
  const bool eager = p.mode == OuterMerge::kEagerCorrect;
  for (int i = 0; i < p.num_tensors; ++i) {
    const OuterTensor& t = p.tensors[i];
    MergeArgs a{t.data, p.global + t.offset, eager ? p.eager + t.offset : nullptr, t.numel,
                p.alpha};
    const bool aligned =
        aligned16(a.param) && aligned16(a.global) && (a.eager == nullptr || aligned16(a.eager));
    const int grid = grid_for(t.numel);
    with_dtype(t.dtype, [&](auto d) {
      with_bool(aligned, [&](auto al) {
        constexpr uint8_t kD = decltype(d)::value;
        constexpr bool kAl = decltype(al)::value;
        if (p.mode == OuterMerge::kMix) {
          outer_merge_v2_kernel<kD, static_cast<uint8_t>(OuterMerge::kMix), kAl>
              <<<grid, kOuterThreads, 0, stream>>>(a);
        } else if (eager) {
          outer_merge_v2_kernel<kD, static_cast<uint8_t>(OuterMerge::kEagerCorrect), kAl>
              <<<grid, kOuterThreads, 0, stream>>>(a);
        } else {
          outer_merge_v2_kernel<kD, static_cast<uint8_t>(OuterMerge::kStore), kAl>
              <<<grid, kOuterThreads, 0, stream>>>(a);
        }
      });
    });
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return launched(err);
  }
  return launched(cudaSuccess);
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
