// OuterSync's outer step over the backend's operations: the outer gradient, the step, the merges,
// and the staging of parameters through host memory where the backend has no outer kernels.
#include <utility>
#include <vector>

#include "gradcomp/outer_sync.h"
#include "math/half.h"
#include "outer_sync_parts.h"

namespace gradcomp {

OuterSync::Staged OuterSync::stage(const Fragment& f, bool read) const {
  Staged s;
  s.tensors = f.tensors;
  if (!host_) return s;
  std::vector<size_t> at;
  size_t total = 0;
  for (const OuterTensor& t : f.tensors) {
    at.push_back(total);
    total += (static_cast<size_t>(t.numel) * math::dtype_bytes(t.dtype) + 15) / 16 * 16;
  }
  s.bytes.resize(total);
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    OuterTensor& t = s.tensors[i];
    const size_t bytes = static_cast<size_t>(t.numel) * math::dtype_bytes(t.dtype);
    if (read) backend_.copy_to_host(s.bytes.data() + at[i], t.data, bytes);
    t.data = s.bytes.data() + at[i];
  }
  return s;
}

void OuterSync::unstage(const Fragment& f, const Staged& s) const {
  if (!host_) return;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const OuterTensor& t = s.tensors[i];
    backend_.copy_from_host(f.tensors[i].data, t.data,
                            static_cast<size_t>(t.numel) * math::dtype_bytes(t.dtype));
  }
}

const float* OuterSync::mean_for_outer(const Fragment& f, std::vector<float>& host) const {
  if (!host_) return reinterpret_cast<const float*>(f.gradient.get());
  host.resize(static_cast<size_t>(f.numel));
  backend_.copy_to_host(host.data(), f.gradient.get(), host.size() * sizeof(float));
  return host.data();
}

void OuterSync::merge_into_params(const Fragment& f, OuterMerge mode) {
  const Staged s = stage(f, mode != OuterMerge::kStore);
  OuterMergeParams p;
  p.tensors = s.tensors.data();
  p.num_tensors = static_cast<int>(s.tensors.size());
  p.numel = f.numel;
  p.global = reinterpret_cast<const float*>(f.anchor.get());
  p.eager = reinterpret_cast<const float*>(f.eager.get());
  p.alpha = options_.mixing;
  p.mode = mode;
  outer().outer_merge(p);
  unstage(f, s);
}

void OuterSync::prepare(Fragment& f) {
  // The outer gradient into the allreduce's buffer: directly, or (staged) into a host copy first.
  const Staged s = stage(f, true);
  std::vector<float> host(host_ ? static_cast<size_t>(f.numel) : 0);
  float* buffer = reinterpret_cast<float*>(f.gradient.get());
  OuterGradientParams p;
  p.tensors = s.tensors.data();
  p.num_tensors = static_cast<int>(s.tensors.size());
  p.numel = f.numel;
  p.anchor = reinterpret_cast<const float*>(f.anchor.get());
  p.gradient = host_ ? host.data() : buffer;
  outer().outer_gradient(p);
  if (host_) backend_.copy_from_host(buffer, host.data(), host.size() * sizeof(float));
}

void OuterSync::outer_step(const Fragment& f, float* anchor_out, float* momentum_out, bool store) {
  std::vector<float> host;
  const Staged s = store ? stage(f, false) : Staged{};
  OuterStepParams p;
  p.anchor = reinterpret_cast<const float*>(f.anchor.get());
  p.gradient = mean_for_outer(f, host);
  p.momentum = reinterpret_cast<const float*>(f.momentum.get());
  p.anchor_out = anchor_out;
  p.momentum_out = momentum_out;
  p.numel = f.numel;
  p.lr = options_.outer_lr;
  p.mu = options_.outer_momentum;
  p.nesterov = options_.nesterov;
  if (store) {
    p.tensors = s.tensors.data();
    p.num_tensors = static_cast<int>(s.tensors.size());
  }
  outer().outer_step(p);
  if (store) unstage(f, s);
}

void OuterSync::apply(uint32_t index, bool finite, bool stepped) {
  Fragment& f = fragments_[index];
  if (!finite) {
    merge_into_params(f, OuterMerge::kStore);
    return;
  }
  const bool eager = f.eager.get() != nullptr;
  const bool store_anchor = !eager && options_.mixing == 0.0f;
  if (stepped) {
    std::swap(f.anchor, f.next_anchor);
    std::swap(f.momentum, f.next_momentum);
    // Only the fragment in flight holds the copies: the old state is the next round's.
    round_buffers_->keep(std::move(f.next_anchor));
    round_buffers_->keep(std::move(f.next_momentum));
    if (store_anchor) merge_into_params(f, OuterMerge::kStore);
  } else {
    // In place, the anchor stored into the parameters in the same pass when nothing merges.
    outer_step(f, reinterpret_cast<float*>(f.anchor.get()),
               reinterpret_cast<float*>(f.momentum.get()), store_anchor);
  }
  ++f.round;
  if (eager) {
    merge_into_params(f, OuterMerge::kEagerCorrect);
  } else if (!store_anchor) {
    merge_into_params(f, OuterMerge::kMix);
  }
}

}  // namespace gradcomp
