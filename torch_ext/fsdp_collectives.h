// FSDP2's collectives through the core over a c10d group: the compressed reduce-scatter (FSDP's
// custom reduce-scatter), the compressed all-reduce across replicas (HSDP's hook) and the int8
// parameter all-gather (FSDP's custom all-gather).
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "gradcomp/gradcomp.h"
#include "process_group_communicator.h"

namespace gradcomp {
namespace torch_ext {

// What both collectives share: the transport and backend bound at the first call (the device,
// and on CUDA the stream current then: FSDP's reduce-scatter or all-reduce stream, whose order
// the work follows), and the counters. FSDP2 has no C++ API: the Python front end drives these.
class FsdpCollective {
 public:
  virtual ~FsdpCollective() = default;
  int world_size() const { return group_->getSize(); }
  const CompressionConfig& config() const { return config_; }
  // Since construction, and of the step in progress (or the last one).
  ReductionStats total_stats() const;
  ReductionStats step_stats() const;
  CompressionState state() const;
  // Before the first call: kept until it binds.
  void load_state(const CompressionState& state);
  // Waits for the verdicts the device has not reported yet (the v2 reduce-scatter's last calls),
  // counts the non-finite buckets among them, and raises a rejected payload's error, counted as
  // the call's would be; nothing to do before
  // the first call or where every call reports its own verdict. Safe to call again.
  void flush();

 protected:
  FsdpCollective(c10::intrusive_ptr<c10d::ProcessGroup> group, CompressionConfig config,
                 std::chrono::milliseconds timeout);
  // Binds at the first call, then runs `run` (core code returning how many non-finite buckets it
  // reported: its own result's, and on a collective whose verdicts come late, those that arrived;
  // its gradcomp::Error becomes a c10::Error) and counts it as one bucket of `step` sending what
  // an uncompressed collective would send in `uncompressed` bytes. Returns what `run` returned.
  uint64_t counted(const at::Tensor& t, uint64_t uncompressed, const std::function<uint64_t()>& run,
                   const std::function<uint32_t()>& step);
  virtual void make_collective(Communicator& comm, Backend& backend) = 0;
  virtual CompressionState collective_state() const = 0;
  virtual void load_collective_state(const CompressionState& state) = 0;
  virtual uint64_t residual_memory() const = 0;
  // The collective's flush (under the lock, once bound): the non-finite buckets it reported.
  virtual uint64_t flush_collective() { return 0; }
  bool bound() const { return device_.has_value(); }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  CompressionConfig config_;
  // The front end named in the core's errors, after their "gradcomp: ": empty for FSDP's.
  std::string failure_prefix_;

 private:
  void bind(const at::Tensor& t);
  // Counts a failed call (or flush) and raises its error as a c10::Error, naming the front end
  // (failure_prefix_).
  [[noreturn]] void count_failure(const Error& e);

  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;  // the collective and its state: held across the network wait
  // The counters alone, so that a metrics scrape never waits behind a collective (a slow or dead
  // peer would otherwise stall every scrape until the group's timeout).
  mutable std::mutex stats_mu_;
  std::optional<at::Device> device_;
  const void* stream_ = nullptr;
  std::unique_ptr<ProcessGroupCommunicator> comm_;
  std::unique_ptr<Backend> backend_;
  std::optional<CompressionState> pending_;
  ReductionStats total_, step_;  // step_: the step of the last call
  uint32_t stats_step_ = 0;
};

// FSDP's reduce-scatter: input of world_size rows of output.numel() elements.
class FsdpReduceScatter final : public FsdpCollective {
 public:
  FsdpReduceScatter(c10::intrusive_ptr<c10d::ProcessGroup> group, CompressionConfig config,
                    std::chrono::milliseconds timeout);
  // Returns false when the output is non-finite.
  bool reduce_scatter(const at::Tensor& output, const at::Tensor& input, uint64_t bucket_id,
                      double divisor);

 private:
  void make_collective(Communicator& comm, Backend& backend) override;
  CompressionState collective_state() const override;
  void load_collective_state(const CompressionState& state) override;
  uint64_t residual_memory() const override { return collective_->residual_memory(); }
  uint64_t flush_collective() override;
  std::unique_ptr<CompressedReduceScatter> collective_;
};

// The mean of a shard across replicas (HSDP's all-reduce hook), in place. Steps advance as the
// reduce-scatter's do: when a bucket already reduced in the current step comes again.
class FsdpReplicaAllreduce final : public FsdpCollective {
 public:
  FsdpReplicaAllreduce(c10::intrusive_ptr<c10d::ProcessGroup> group, CompressionConfig config,
                       std::chrono::milliseconds timeout);
  bool allreduce(const at::Tensor& tensor, uint64_t bucket_id);

 private:
  void make_collective(Communicator& comm, Backend& backend) override;
  CompressionState collective_state() const override;
  void load_collective_state(const CompressionState& state) override;
  uint64_t residual_memory() const override { return collective_->residual_memory(); }
  std::unique_ptr<CompressedAllreduce> collective_;
  StepRounds rounds_;
};

// FSDP's parameter all-gather as int8 (CompressedAllGather): the output holds world_size rows of
// the input's bytes, the input being this rank's row of it (FSDP's all_gather_copy_in). `runs`
// lays the row out as (dtype, elements) stretches: one for a row of one dtype, several when FSDP
// gathers parameters of several dtypes as uint8 bytes. No state to checkpoint: weights are never
// kept quantized.
class FsdpAllGather final : public FsdpCollective {
 public:
  // `front_end`: the name a C++ front end over this collective (gradcomp::WeightAllGather) gives
  // it, which then opens every error of its calls; FSDP's errors say "FSDP all-gather".
  FsdpAllGather(c10::intrusive_ptr<c10d::ProcessGroup> group, AllGatherOptions options,
                std::chrono::milliseconds timeout,
                const std::optional<std::string>& front_end = std::nullopt);
  // `backward`: the all-gather before a module's backward (its stats count with the forward's in
  // one step); `name` goes into errors.
  void all_gather(const at::Tensor& output, const at::Tensor& input,
                  const std::vector<AllGatherRun>& runs, uint64_t bucket_id,
                  const std::string& name, bool backward);

 private:
  void make_collective(Communicator& comm, Backend& backend) override;
  CompressionState collective_state() const override;
  void load_collective_state(const CompressionState&) override {}
  uint64_t residual_memory() const override { return 0; }
  AllGatherOptions options_;
  std::string label_;  // opens the errors of this collective's own checks
  std::unique_ptr<CompressedAllGather> collective_;
  StepRounds rounds_;
};

}  // namespace torch_ext
}  // namespace gradcomp
