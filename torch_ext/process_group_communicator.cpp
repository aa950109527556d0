// c10d collectives behind the core's Communicator, each a named profiler phase.
#include "process_group_communicator.h"

#include "gradcomp/shm_communicator.h"
#include "profiled_communicator.h"
#include "profiler_ranges.h"
#include "tensor_params.h"
#include "torch_compat.h"

namespace gradcomp {
namespace torch_ext {

ProcessGroupCommunicator::ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                   at::Device device,
                                                   std::chrono::milliseconds timeout)
    : group_(std::move(group)), device_(device), timeout_(timeout) {}

void ProcessGroupCommunicator::wait(const c10::intrusive_ptr<c10d::Work>& work) const {
  work->wait(timeout_);
}

at::Tensor ProcessGroupCommunicator::wrap(void* p, int64_t numel, at::ScalarType type) const {
  return at::from_blob(p, {numel}, at::TensorOptions().dtype(type).device(device_));
}

void ProcessGroupCommunicator::run_all_to_all(const void* send, void* recv, size_t bytes) {
  GRADCOMP_PHASE("gradcomp::all_to_all");
  const int64_t total = static_cast<int64_t>(bytes) * world_size();
  at::Tensor in = wrap(const_cast<void*>(send), total, at::kByte);
  at::Tensor out = wrap(recv, total, at::kByte);
  wait(compat::all_to_all_single(*group_, out, in));
}

void ProcessGroupCommunicator::run_all_gather(const void* send, void* recv, size_t bytes) {
  GRADCOMP_PHASE("gradcomp::all_gather");
  at::Tensor in = wrap(const_cast<void*>(send), static_cast<int64_t>(bytes), at::kByte);
  at::Tensor out = wrap(recv, static_cast<int64_t>(bytes) * world_size(), at::kByte);
  wait(compat::all_gather_single(*group_, out, in));
}

void ProcessGroupCommunicator::run_allreduce_mean(void* data, int64_t numel, DType dtype) {
  GRADCOMP_PHASE("gradcomp::allreduce");
  at::Tensor bucket = wrap(data, numel, to_scalar_type(dtype));
  bucket.mul_(1.0 / static_cast<double>(world_size()));
  std::vector<at::Tensor> tensors = {bucket};
  wait(group_->allreduce(tensors));
}

void ProcessGroupCommunicator::run_reduce_scatter_mean(const void* send, void* recv,
                                                       int64_t numel_per_rank, DType dtype) {
  GRADCOMP_PHASE("gradcomp::reduce_scatter");
  const at::ScalarType type = to_scalar_type(dtype);
  at::Tensor in = wrap(const_cast<void*>(send), numel_per_rank * world_size(), type);
  at::Tensor out = wrap(recv, numel_per_rank, type);
  at::Tensor scaled = in.mul(1.0 / static_cast<double>(world_size()));
  wait(compat::reduce_scatter_single(*group_, out, scaled));
}

NodeCommunicators node_communicators(const c10::intrusive_ptr<c10d::ProcessGroup>& intra_node,
                                     const c10::intrusive_ptr<c10d::ProcessGroup>& inter_node,
                                     at::Device device, std::chrono::milliseconds timeout,
                                     const std::string& shm_name) {
  GRADCOMP_CHECK(intra_node && inter_node,
                 "node process groups need both the intra-node and the inter-node group");
  NodeCommunicators c;
  if (device.is_cpu() && !shm_name.empty()) {
    const double seconds = timeout.count() > 0 ? timeout.count() / 1e3 : 300.0;
    c.intra_node = std::make_unique<ProfiledCommunicator>(std::make_unique<ShmCommunicator>(
        shm_name, intra_node->getRank(), intra_node->getSize(), seconds));
  } else {
    c.intra_node = std::make_unique<ProcessGroupCommunicator>(intra_node, device, timeout);
  }
  c.inter_node = std::make_unique<ProcessGroupCommunicator>(inter_node, device, timeout);
  return c;
}

}  // namespace torch_ext
}  // namespace gradcomp
