// FSDP2's gradient reduce-scatter through the core's CompressedReduceScatter, over a c10d group.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "gradcomp/gradcomp.h"
#include "process_group_communicator.h"

namespace gradcomp {
namespace torch_ext {

// One process group's compressed reduce-scatter for the Python FSDP front end (FSDP2 has no C++
// API). Bound to the device, and on CUDA to the stream current at the first call (FSDP's
// reduce-scatter stream): the work runs in that stream's order.
class FsdpReduceScatter {
 public:
  FsdpReduceScatter(c10::intrusive_ptr<c10d::ProcessGroup> group, CompressionConfig config,
                    std::chrono::milliseconds timeout);

  // input: world_size rows of output.numel() elements (FSDP's layout), output: one row; both
  // contiguous, of one dtype, on one device. Returns false when the output is non-finite.
  bool reduce_scatter(const at::Tensor& output, const at::Tensor& input, uint64_t bucket_id,
                      double divisor);

  int world_size() const { return group_->getSize(); }
  const CompressionConfig& config() const { return config_; }
  // Since construction, and of the step in progress (or the last one).
  ReductionStats total_stats() const;
  ReductionStats step_stats() const;
  CompressionState state() const;
  void load_state(const CompressionState& state);

 private:
  void bind(const at::Tensor& t);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  CompressionConfig config_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::optional<at::Device> device_;
  const void* stream_ = nullptr;  // CUDA: the stream bound at the first call
  std::unique_ptr<ProcessGroupCommunicator> comm_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<CompressedReduceScatter> collective_;
  std::optional<CompressionState> pending_;  // loaded before the first call
  ReductionStats total_, step_;              // step_: the step of the last call
  uint32_t stats_step_ = 0;
};

}  // namespace torch_ext
}  // namespace gradcomp
