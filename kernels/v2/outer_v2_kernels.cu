// DiLoCo's outer step v2 kernels: the outer gradient, the SGD step and the merge, one launch per
// dtype over a fragment's tensors (a device table), 8 elements a thread in 16-byte accesses
// where aligned. Bytes equal cpu_outer.cpp's.
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

// The fp32 state's pointers of one launch; a tensor's stretch starts at its table offset.
struct GradientArgs {
  const float* anchor;  // unused when widening
  float* gradient;
};
struct StepArgs {
  const float* anchor;
  const float* gradient;
  const float* momentum;
  float* anchor_out;    // may be anchor
  float* momentum_out;  // may be momentum; unused without kKeep
  float lr, mu;
};
struct MergeArgs {
  const float* global;
  const float* eager;  // kEagerCorrect only
  float alpha;
};

// Every access to memory here (span_io.cuh's): the step writes its anchor and buffer in place,
// and a parameter's bits reach the outer gradient as the CPU's conversions give them.
constexpr Access kIo = Access::kInPlace;
static_assert(kOuterVec == kLaneElements, "span_io.cuh's 8-element accesses");

template <uint8_t D>
__device__ __forceinline__ char* element_address(void* data, int64_t e) {
  return static_cast<char*>(data) + e * (D == math::kDtypeF32 ? 4 : 2);
}

// A launch over one dtype's run of the fragment's tensors (outer_v2_map.h): thread g takes units
// g, g + stride, ... of the run, each a 16-byte group or one element of the tensor holding it.
// kGrouped false (a state array not 16-byte aligned): every element singly.
struct RunArgs {
  const OuterTableEntry* table;  // the run's entries, device memory
  int count;
  int64_t units;  // the run's units (kGrouped) or elements
};

// ---- the outer gradient: gradient = anchor - param (or param, widening the first anchor) ----

template <uint8_t D, bool kWiden, bool kGrouped>
__global__ void __launch_bounds__(kOuterThreads)
    outer_gradient_v2_kernel(const RunArgs run, const GradientArgs a) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // Not unrolled: a trip count would cost a 64-bit division.
#pragma unroll 1
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < run.units;
       u += stride) {
    const OuterUnit w = outer_unit_at(run.table, run.count, u, kGrouped);
    if (w.group) {
      float p[kOuterVec];
      load8_aligned<D, kIo>(element_address<D>(w.data, w.element), p);
      if constexpr (!kWiden) {
        float an[kOuterVec];
        load8_aligned<math::kDtypeF32, kIo>(a.anchor + w.state, an);
#pragma unroll
        for (int j = 0; j < kOuterVec; ++j) p[j] = math::outer_gradient(an[j], p[j]);
      }
      store8_aligned<math::kDtypeF32, kIo>(a.gradient + w.state, p);
    } else {
      const float p = load1<D, kIo>(w.data, w.element);
      a.gradient[w.state] = kWiden ? p : math::outer_gradient(a.anchor[w.state], p);
    }
  }
}

// ---- the SGD step: new anchor and buffer (math::outer_sgd), the anchor stored into the tensors
// of the run, or (kNoStore) into none: then one flat range of the state, no table ----
template <uint8_t D, bool kNesterov, bool kKeep>
__device__ __forceinline__ void step_group(const StepArgs& a, int64_t s, void* param) {
  float an[kOuterVec], gr[kOuterVec], buf[kOuterVec];
  load8_aligned<math::kDtypeF32, kIo>(a.anchor + s, an);
  load8_aligned<math::kDtypeF32, kIo>(a.gradient + s, gr);
  load8_aligned<math::kDtypeF32, kIo>(a.momentum + s, buf);
#pragma unroll
  for (int j = 0; j < kOuterVec; ++j)
    an[j] = math::outer_sgd(an[j], gr[j], &buf[j], a.lr, a.mu, kNesterov);
  store8_aligned<math::kDtypeF32, kIo>(a.anchor_out + s, an);
  if constexpr (kKeep) store8_aligned<math::kDtypeF32, kIo>(a.momentum_out + s, buf);
  if constexpr (D != kNoStore) store8_aligned<D, kIo>(param, an);
}

template <uint8_t D, bool kNesterov, bool kKeep>
__device__ __forceinline__ void step_one(const StepArgs& a, int64_t s, void* data, int64_t e) {
  float buf = a.momentum[s];
  const float an = math::outer_sgd(a.anchor[s], a.gradient[s], &buf, a.lr, a.mu, kNesterov);
  a.anchor_out[s] = an;
  if constexpr (kKeep) a.momentum_out[s] = buf;
  if constexpr (D != kNoStore) store1<D, kIo>(data, e, an);
}

template <uint8_t D, bool kNesterov, bool kKeep, bool kGrouped>
__global__ void __launch_bounds__(kOuterThreads)
    outer_step_v2_kernel(const RunArgs run, const StepArgs a) {
  if constexpr (D == kNoStore) {
    // run.units is the fragment's element count here.
    const OuterThreadMap m =
        outer_thread_map(blockIdx.x, blockDim.x, threadIdx.x, gridDim.x, run.units, kGrouped);
    // Not unrolled: a trip count would cost a 64-bit division.
#pragma unroll 1
    for (int64_t g = m.first_group; g < m.groups; g += m.stride)
      step_group<D, kNesterov, kKeep>(a, g * kOuterVec, nullptr);
#pragma unroll 1
    for (int64_t e = m.first_tail; e < run.units; e += m.stride)
      step_one<D, kNesterov, kKeep>(a, e, nullptr, e);
  } else {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
#pragma unroll 1
    for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < run.units;
         u += stride) {
      const OuterUnit w = outer_unit_at(run.table, run.count, u, kGrouped);
      if (w.group) {
        step_group<D, kNesterov, kKeep>(a, w.state, element_address<D>(w.data, w.element));
      } else {
        step_one<D, kNesterov, kKeep>(a, w.state, w.data, w.element);
      }
    }
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

template <uint8_t D, uint8_t kMode, bool kGrouped>
__global__ void __launch_bounds__(kOuterThreads)
    outer_merge_v2_kernel(const RunArgs run, const MergeArgs a) {
  constexpr bool kReads = kMode != static_cast<uint8_t>(OuterMerge::kStore);
  constexpr bool kEager = kMode == static_cast<uint8_t>(OuterMerge::kEagerCorrect);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // Not unrolled: a trip count would cost a 64-bit division.
#pragma unroll 1
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < run.units;
       u += stride) {
    const OuterUnit w = outer_unit_at(run.table, run.count, u, kGrouped);
    if (w.group) {
      void* at = element_address<D>(w.data, w.element);
      float p[kOuterVec] = {}, gl[kOuterVec], ea[kOuterVec] = {};
      load8_aligned<math::kDtypeF32, kIo>(a.global + w.state, gl);
      if constexpr (kReads) load8_aligned<D, kIo>(at, p);
      if constexpr (kEager) load8_aligned<math::kDtypeF32, kIo>(a.eager + w.state, ea);
#pragma unroll
      for (int j = 0; j < kOuterVec; ++j) p[j] = merge_rule<kMode>(p[j], gl[j], ea[j], a.alpha);
      store8_aligned<D, kIo>(at, p);
    } else {
      const float p = kReads ? load1<D, kIo>(w.data, w.element) : 0.0f;
      store1<D, kIo>(
          w.data, w.element,
          merge_rule<kMode>(p, a.global[w.state], kEager ? a.eager[w.state] : 0.0f, a.alpha));
    }
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

// Blocks for `units` units of work, one a thread.
int grid_for(int64_t units) {
  const int64_t blocks = (units + kOuterThreads - 1) / kOuterThreads;
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

// The device table must be the one built from these tensors: the same number of them.
const char* table_problem(const OuterDeviceTable& table, int num_tensors) {
  int count = 0;
  for (const OuterTableRun& r : table.runs) count += r.count;
  if (table.entries == nullptr || count != num_tensors)
    return "the device table is not the fragment's (a different number of tensors)";
  return nullptr;
}

LaunchStatus rejected(const char* why) {
  LaunchStatus s;
  s.rejected = why;
  return s;
}

// One launch for each dtype the fragment has: f(dtype tag, its run's args, grid, grouped).
template <typename F>
cudaError_t for_each_run(const OuterDeviceTable& table, bool grouped, F&& f) {
  for (int d = 0; d < kOuterDtypes; ++d) {
    const OuterTableRun& r = table.runs[d];
    const int64_t units = grouped ? r.units : r.elements;
    if (units == 0) continue;
    const RunArgs run{table.entries + r.first, r.count, units};
    with_dtype(static_cast<uint8_t>(d),
               [&](auto dtype) { with_bool(grouped, [&](auto g) { f(dtype, g, run); }); });
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

LaunchStatus run_outer_gradient(const OuterGradientParams& p, const OuterDeviceTable& table,
                                cudaStream_t stream) {
  if (const char* r = params_problem(p)) return rejected(r);
  if (const char* r = tensors_problem(p.tensors, p.num_tensors, p.numel)) return rejected(r);
  if (const char* r = table_problem(table, p.num_tensors)) return rejected(r);
  const GradientArgs a{p.anchor, p.gradient};
  const bool grouped = aligned16(p.gradient) && (p.anchor == nullptr || aligned16(p.anchor));
  return launched(for_each_run(table, grouped, [&](auto d, auto g, const RunArgs& run) {
    with_bool(p.anchor == nullptr, [&](auto widen) {
      outer_gradient_v2_kernel<decltype(d)::value, decltype(widen)::value, decltype(g)::value>
          <<<grid_for(run.units), kOuterThreads, 0, stream>>>(run, a);
    });
  }));
}

LaunchStatus run_outer_step(const OuterStepParams& p, const OuterDeviceTable& table,
                            cudaStream_t stream) {
  if (const char* r = params_problem(p)) return rejected(r);
  if (p.num_tensors > 0) {
    if (const char* r = tensors_problem(p.tensors, p.num_tensors, p.numel)) return rejected(r);
    if (const char* r = table_problem(table, p.num_tensors)) return rejected(r);
  }
  const StepArgs a{p.anchor, p.gradient, p.momentum, p.anchor_out, p.momentum_out, p.lr, p.mu};
  const bool grouped = aligned16(a.anchor) && aligned16(a.gradient) && aligned16(a.momentum) &&
                       aligned16(a.anchor_out) &&
                       (a.momentum_out == nullptr || aligned16(a.momentum_out));
  auto launch = [&](auto d, auto g, const RunArgs& run) {
    // The flat range's units are its elements, 8 a thread where grouped.
    const bool flat_groups = decltype(d)::value == kNoStore && decltype(g)::value;
    const int grid = grid_for(flat_groups ? (run.units + kOuterVec - 1) / kOuterVec : run.units);
    with_bool(p.nesterov, [&](auto nesterov) {
      with_bool(p.momentum_out != nullptr, [&](auto keep) {
        outer_step_v2_kernel<decltype(d)::value, decltype(nesterov)::value, decltype(keep)::value,
                             decltype(g)::value><<<grid, kOuterThreads, 0, stream>>>(run, a);
      });
    });
  };
  if (p.num_tensors > 0) return launched(for_each_run(table, grouped, launch));
  // Without a store one launch covers the fragment's state as one range.
  with_bool(grouped, [&](auto g) { launch(U8<kNoStore>{}, g, RunArgs{nullptr, 0, p.numel}); });
  return launched(cudaGetLastError());
}

LaunchStatus run_outer_merge(const OuterMergeParams& p, const OuterDeviceTable& table,
                             cudaStream_t stream) {
  if (const char* r = params_problem(p)) return rejected(r);
  if (const char* r = tensors_problem(p.tensors, p.num_tensors, p.numel)) return rejected(r);
  if (const char* r = table_problem(table, p.num_tensors)) return rejected(r);
  const bool eager = p.mode == OuterMerge::kEagerCorrect;
  const MergeArgs a{p.global, eager ? p.eager : nullptr, p.alpha};
  const bool grouped = aligned16(p.global) && (!eager || aligned16(p.eager));
  return launched(for_each_run(table, grouped, [&](auto d, auto g, const RunArgs& run) {
    constexpr uint8_t kD = decltype(d)::value;
    constexpr bool kG = decltype(g)::value;
    const int grid = grid_for(run.units);
    if (p.mode == OuterMerge::kMix) {
      outer_merge_v2_kernel<kD, static_cast<uint8_t>(OuterMerge::kMix), kG>
          <<<grid, kOuterThreads, 0, stream>>>(run, a);
    } else if (eager) {
      outer_merge_v2_kernel<kD, static_cast<uint8_t>(OuterMerge::kEagerCorrect), kG>
          <<<grid, kOuterThreads, 0, stream>>>(run, a);
    } else {
      outer_merge_v2_kernel<kD, static_cast<uint8_t>(OuterMerge::kStore), kG>
          <<<grid, kOuterThreads, 0, stream>>>(run, a);
    }
  }));
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
