// Every difference between the PyTorch versions the torch layer supports (2.7 to 2.15), in one
// place.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <utility>

#if defined(GRADCOMP_HAVE_CUDA)
#if __has_include(<c10/cuda/CUDAEvent.h>)
#include <c10/cuda/CUDAEvent.h>
#else
#include <ATen/cuda/CUDAEvent.h>
#endif
#endif

namespace gradcomp {
namespace torch_ext {
namespace compat {

// Autograd nodes are held by std::shared_ptr in older torch (2.7, 2.11) and by c10::intrusive_ptr
// in newer (2.15).
using NodePtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

#if defined(GRADCOMP_HAVE_CUDA)
// c10::cuda::CUDAEvent in newer torch (2.15), at::cuda::CUDAEvent in older (2.7), which newer
// versions dropped.
#if __has_include(<c10/cuda/CUDAEvent.h>)
using CudaEvent = c10::cuda::CUDAEvent;
#else
using CudaEvent = at::cuda::CUDAEvent;
#endif
#endif

// c10d's single-tensor collectives are all_to_all_single, all_gather_single and
// reduce_scatter_single in newer torch (2.15); older ones (2.7, 2.11) have only alltoall_base,
// _allgather_base and _reduce_scatter_base (deprecated forwarders in newer ones). The group is a
// template parameter so that only the branch this torch has is instantiated.
template <typename Group>
c10::intrusive_ptr<c10d::Work> all_to_all_single(Group& group, at::Tensor& out, at::Tensor& in) {
  std::vector<int64_t> splits;  // empty: equal splits
  if constexpr (requires { group.all_to_all_single(out, in, splits, splits); }) {
    return group.all_to_all_single(out, in, splits, splits);
  } else {
    return group.alltoall_base(out, in, splits, splits);
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> all_gather_single(Group& group, at::Tensor& out, at::Tensor& in) {
  if constexpr (requires { group.all_gather_single(out, in); }) {
    return group.all_gather_single(out, in);
  } else {
    return group._allgather_base(out, in);
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> reduce_scatter_single(Group& group, at::Tensor& out,
                                                     at::Tensor& in) {
  if constexpr (requires { group.reduce_scatter_single(out, in); }) {
    return group.reduce_scatter_single(out, in);
  } else {
    return group._reduce_scatter_base(out, in);
  }
}

// The factor of a c10d PREMUL_SUM ReduceOp (a double or a one-element tensor in its supplement).
// Python reads `op.factor` in newer torch (2.15); older ones (2.9, 2.11) expose no accessor, so
// their FSDP's PREMUL_SUM is read here. Throws for another op or a missing factor.
double premul_sum_factor(const c10d::ReduceOp& op);

// The store a process group was made over: ProcessGroup::getStore where this torch has it
// (2.11 and 2.15 do; 2.7 does not), else the store gradcomp recorded when it made the group
// (remember_store); null for a group made elsewhere on a torch without getStore.
c10::intrusive_ptr<c10d::Store> recorded_store(const c10::intrusive_ptr<c10d::ProcessGroup>& group);
void remember_store(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                    c10::intrusive_ptr<c10d::Store> store);

template <typename Group>
c10::intrusive_ptr<c10d::Store> store_of(const c10::intrusive_ptr<Group>& group) {
  if constexpr (requires { group->getStore(); }) {
    return group->getStore();
  } else {
    return recorded_store(group);
  }
}

}  // namespace compat
}  // namespace torch_ext
}  // namespace gradcomp
