// The core's Communicator over a c10d ProcessGroup (Gloo or NCCL), for the torch front ends.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "gradcomp/collectives.h"
#include "gradcomp/communicator.h"

namespace gradcomp {
namespace torch_ext {

// Collectives wait for their c10d work (on CUDA: the work is ordered on the current stream),
// at most `timeout` when it is not zero (a deadline of the hook's own, below the process
// group's timeout; a collective that misses it leaves the group unusable, as a timeout does).
class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, at::Device device,
                           std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  int rank() const override { return group_->getRank(); }
  int world_size() const override { return group_->getSize(); }
  bool device_memory() const override { return device_.is_cuda(); }

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes_per_rank) override;
  void run_all_gather(const void* send, void* recv, size_t bytes_per_rank) override;
  // As DDP without a hook: each rank scales by 1/W, then a SUM allreduce, so the uncompressed
  // path through gradcomp is bit-identical to plain DDP.
  void run_allreduce_mean(void* data, int64_t numel, DType dtype) override;
  // The same rounding: a copy of send scaled by 1/W, then a SUM reduce-scatter.
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                               DType dtype) override;

 private:
  at::Tensor wrap(void* p, int64_t numel, at::ScalarType type) const;

  void wait(const c10::intrusive_ptr<c10d::Work>& work) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Device device_;
  std::chrono::milliseconds timeout_;
};

// The communicators of a hierarchical reduction over node process groups, for both front ends:
// inside the node shared memory named `shm_name` for CPU tensors (when not empty), else the
// intra-node group; across nodes the inter-node group.
struct NodeCommunicators {
  std::unique_ptr<Communicator> intra_node;
  std::unique_ptr<ProcessGroupCommunicator> inter_node;
  NodeGroups groups() const { return {intra_node.get(), inter_node.get()}; }
};
NodeCommunicators node_communicators(const c10::intrusive_ptr<c10d::ProcessGroup>& intra_node,
                                     const c10::intrusive_ptr<c10d::ProcessGroup>& inter_node,
                                     at::Device device, std::chrono::milliseconds timeout,
                                     const std::string& shm_name);

}  // namespace torch_ext
}  // namespace gradcomp
