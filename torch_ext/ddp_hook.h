// The DDP communication hook: tensors and futures around the core's BucketEngine.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Stream.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <unordered_map>
#include <vector>

#include "gradcomp/fault_injection.h"
#include "gradcomp/gradcomp.h"
#include "gradcomp/torch.h"
#include "process_group_communicator.h"

namespace gradcomp {
namespace torch_ext {

// A codec's engine options, with the profiler's context carried to the engine's worker thread.
EngineOptions ddp_engine_options(const CodecSpec& codec);

// One hook's state, shared by the comm hook DDP's reducer owns and the Python handle. CPU
// buckets are reduced on the engine's worker thread; CUDA buckets on a compression stream of
// this hook, ordered after the stream that filled them, with nothing waiting for the device.
class DdpHook {
 public:
  // `timeout`: the hook's deadline for one collective (0: the process group's). `fault`: for
  // tests only, a transport fault to inject (gradcomp/fault_injection.h).
  DdpHook(c10::intrusive_ptr<c10d::ProcessGroup> group, EngineOptions options,
          std::chrono::milliseconds timeout = std::chrono::milliseconds(0),
          FaultSpec fault = FaultSpec{}, NodeProcessGroups nodes = {}, std::string shm_name = "");

  // The DDP model's parameters in order (the register route): buckets are then recorded by
  // parameter, so the first step after a restart can reduce the layouts the checkpoint saved.
  void set_parameters(const std::vector<at::Tensor>& params);
  int64_t param_index(const at::Tensor& param) const;  // -1: not one of them

  // Queues one bucket; the future completes with the averaged bucket (written in place).
  c10::intrusive_ptr<c10::ivalue::Future> submit(at::Tensor bucket, int64_t index,
                                                 uint64_t identity, bool is_last,
                                                 std::vector<ParamSlice> params = {});
  // Averages one bucket on the calling thread (the standard route); on CUDA the current stream
  // is ordered after the result.
  void reduce(at::Tensor bucket, int64_t index, uint64_t identity, bool is_last);

  BucketEngine& engine() { return engine_; }
  const BucketEngine& engine() const { return engine_; }
  int world_size() const { return group_->getSize(); }

 private:
  // Binds the engine at the first bucket: transport and backend for its device, and on CUDA the
  // compression stream. Later buckets must be on the same device.
  void bind(const at::Tensor& bucket);
  BucketRequest request(const at::Tensor& bucket, int64_t index, uint64_t identity, bool is_last,
                        std::vector<ParamSlice> params) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  bool compress_;
  KernelGeneration kernels_;  // the CUDA backend's kernels (the codec spec's choice)
  std::mutex bind_mu_;
  std::optional<at::Device> device_;
  std::optional<c10::Stream> cuda_stream_;  // the compression stream
  std::chrono::milliseconds timeout_;
  FaultSpec fault_;
  std::unique_ptr<ProcessGroupCommunicator> comm_;
  std::unique_ptr<FaultInjectingCommunicator> faulty_;
  NodeProcessGroups nodes_;
  // On the CPU the node's ranks exchange through shared memory of this name (empty: through the
  // intra-node process group).
  std::string shm_name_;
  NodeCommunicators node_comms_;
  std::unique_ptr<Backend> backend_;  // this hook's own, so no other caller shares its flags
  // Its own lock: DDP looks parameters up on the autograd thread while the worker reduces.
  mutable std::mutex params_mu_;
  std::unordered_map<const c10::TensorImpl*, int64_t> param_index_;
  BucketEngine engine_;  // last: destroyed first, while the transport and backend still live
};

// What DDP's reducer owns: forwards each bucket to the shared DdpHook.
class GradcompCommHook final : public c10d::CommHookInterface {
 public:
  explicit GradcompCommHook(std::shared_ptr<DdpHook> hook) : hook_(std::move(hook)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;

 private:
  std::shared_ptr<DdpHook> hook_;
};

// A bucket's identity from its DDP index, buffer and parameters' shapes.
uint64_t ddp_bucket_identity(int64_t index, const at::Tensor& buffer,
                             const std::vector<std::vector<int64_t>>& param_shapes);

}  // namespace torch_ext
}  // namespace gradcomp
