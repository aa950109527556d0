// gradcomp for C++ libtorch training programs: GradSync (compressed, overlapped data
// parallelism), DiLoCo, the weight all-gather and a process group from torchrun's
// environment. Target gradcomp::torch.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <chrono>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "gradcomp/gradcomp.h"

namespace gradcomp {

// A process group from the variables torchrun sets (MASTER_ADDR, MASTER_PORT, RANK,
// WORLD_SIZE), or Slurm's under srun without torchrun (gradcomp::launch_env): "gloo" (CPU
// tensors) or "nccl" (CUDA tensors, CUDA builds). Collectives that do not complete within
// `timeout` raise instead of hanging.
c10::intrusive_ptr<c10d::ProcessGroup> process_group_from_env(
    const std::string& backend = "gloo",
    std::chrono::milliseconds timeout = std::chrono::seconds(60));

// The process groups of a hierarchical reduction (uncompressed inside a node, compressed between
// nodes): this rank's node, and this local rank on every node. Both null: the flat scheme.
struct NodeProcessGroups {
  c10::intrusive_ptr<c10d::ProcessGroup> intra_node, inter_node;
};

// Splits `group` into node groups for `local_world_size` ranks per node, node-major (rank = node
// * L + local rank, as torchrun numbers them), over the group's store: "gloo" or "nccl" groups.
// Every rank of `group` calls it. 1: the flat scheme (both null); 0: the launcher's ranks per
// node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks per node) when the job spans more than one
// node, else flat.
NodeProcessGroups split_node_groups(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                    int local_world_size, const std::string& backend = "gloo",
                                    std::chrono::milliseconds timeout = std::chrono::seconds(60));

struct GradSyncOptions {
  // Buckets hold parameters in reverse registration order, as DDP's do: backward produces the
  // last parameters' gradients first. The first bucket is small so the network starts early.
  int64_t bucket_cap_bytes = int64_t{25} << 20;
  int64_t first_bucket_cap_bytes = int64_t{1} << 20;
  // Parameters whose gradient does not arrive in a step count as zero on this rank (and keep
  // their .grad when no rank used them). Off: finish() raises naming them.
  bool find_unused_parameters = false;
  // Copies rank 0's parameter values to every rank when the GradSync is made.
  bool broadcast_parameters = true;
  // The longest one collective may take before finish() raises (0: the process group's
  // timeout); a collective that misses it leaves the group unusable, as a timeout does.
  std::chrono::milliseconds collective_timeout{0};
  // Ranks per node for the hierarchical scheme (split_node_groups: 0 reads LOCAL_WORLD_SIZE);
  // 1: flat. Ignored when node_groups is given.
  int local_world_size = 1;
  NodeProcessGroups node_groups;
  // On the CPU a node's ranks exchange through shared memory (gradcomp::ShmCommunicator);
  // false: through the intra-node process group. CUDA always uses the group (NCCL).
  bool node_shared_memory = true;
  // Where the thread compressing CPU buckets runs (EngineOptions::worker_cpus): "auto" (the
  // constructing thread's CPUs, unless OpenMP bound it to one core: then also the cores no
  // thread is bound to), "inherit", or a CPU list such as "6-7".
  std::string worker_cpus = "auto";
};

struct GradSyncStats {
  ReductionStats step;   // the last synchronised step
  ReductionStats total;  // since the GradSync was made
  // The last step, on the host clock: from the first gradient to finish(), the buckets'
  // reductions (on CUDA: the time to queue them), the part of those inside the backward window,
  // and the time finish() waited for the rest.
  double backward_seconds = 0;
  double reduction_seconds = 0;
  double overlapped_seconds = 0;
  double finish_wait_seconds = 0;
};

// Averages the gradients of `parameters` over the process group through gradcomp, bucket by
// bucket while backward runs:
//
//   gradcomp::GradSync sync(model->parameters(), group, gradcomp::Q4{});
//   for (...) { loss.backward(); sync.finish(); optimizer.step(); }
//
// Each bucket is compressed the moment its last gradient is accumulated, on the engine's
// worker thread (CPU) or its compression stream (CUDA), with the same engine and arithmetic as
// the DDP hook. finish() waits for every bucket and writes the averaged gradients back.
class GradSync {
 public:
  GradSync(std::vector<at::Tensor> parameters, c10::intrusive_ptr<c10d::ProcessGroup> group,
           CodecSpec codec = Q4{}, GradSyncOptions options = {});
  GradSync(const torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group,
           CodecSpec codec = Q4{}, GradSyncOptions options = {});
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Waits for this step's buckets and writes the averaged gradients into each parameter's
  // .grad; raises Error (naming step, bucket or parameter) when one failed. Does nothing inside
  // a no_sync() scope.
  void finish();

  // While the returned guard lives, backward only accumulates gradients locally; the first
  // backward after it synchronises the accumulated sum.
  class NoSync {
   public:
    explicit NoSync(GradSync& sync);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    GradSync& sync_;
  };
  NoSync no_sync() { return NoSync(*this); }

  GradSyncStats stats() const;
  // This rank's counters since construction in Prometheus's text format (gradcomp_* metrics,
  // labelled with rank, local rank, host, codec and front_end="gradsync"); write_metrics writes
  // them to `path` atomically, for node_exporter's textfile collector (docs/operations.md).
  std::string metrics_text() const;
  void write_metrics(const std::string& path) const;
  // The bucket assignment: each bucket's parameter positions (into `parameters`), in order.
  std::vector<std::vector<int64_t>> buckets() const;
  int rank() const;
  int world_size() const;
  // The CPUs the worker thread may run on (empty on CUDA: no worker), and why.
  std::vector<int> worker_cpus() const;
  std::string worker_placement() const;

  // Residuals, step counter, seed and bucket layouts: everything a bit-identical resume needs
  // (each rank saves its own). load() refuses a damaged or foreign record as a whole.
  EngineState state() const;
  void load_state(EngineState state);
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Throws Error when `optimizer` does not fit the codec's contract: TopK with momentum > 0
// (momentum correction) applies the momentum itself, so the optimizer must be torch::optim::SGD
// with momentum 0 and no Nesterov in every parameter group. Warns (TORCH_WARN) when TopK meets
// Adam, AdamW, Adagrad or RMSprop (adaptive_optimizer_warning). Other codecs take any optimizer.
void check_optimizer(const torch::optim::Optimizer& optimizer, const CodecSpec& codec);

// torch::save(sync, path) / torch::load(sync, path).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradSync& sync);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, GradSync& sync);

struct DiLoCoOptions {
  // H, the outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9) and streaming fragments.
  OuterSyncOptions outer;
  // Copies rank 0's parameter values to every rank when the DiLoCo is made (DiLoCo needs one
  // start everywhere). Between rounds each rank's parameters are its own: a program that
  // restores a checkpoint before making the DiLoCo sets this to false (or loads it after).
  bool broadcast_parameters = true;
  // The longest one collective may take (0: the process group's timeout).
  std::chrono::milliseconds collective_timeout{0};
  // Ranks per node for the hierarchical allreduce of the outer gradient (as GradSync's).
  int local_world_size = 1;
  NodeProcessGroups node_groups;
  // The inner steps the run will take (0: unknown), for the short-run warning only: with the
  // default outer settings and fewer than kShortRunRounds rounds, or an unknown length, the
  // DiLoCo warns once, when it is made, with the measured numbers (short_run_warning).
  uint64_t planned_steps = 0;
  // false: no short-run warning (the defaults chosen knowingly, or a front end that warned
  // already: the Python one tells passed settings from defaults, which C++ cannot).
  bool warn_short_run = true;
};

// DiLoCo: every rank trains with its own optimizer, and every H inner steps the outer gradient
// (the parameters at the round's start minus now) is averaged through gradcomp's compressed
// allreduce and an outer Nesterov SGD moves the shared parameters (gradcomp::OuterSync):
//
//   gradcomp::DiLoCo diloco(model->parameters(), group, gradcomp::Q4{}, options);
//   for (...) { loss.backward(); optimizer.step(); diloco.step(); }
//
// No gradient is synchronised between rounds: the model is not wrapped in GradSync or DDP. The
// outer state (fp32 anchors and momenta) is kept in host memory.
class DiLoCo {
 public:
  DiLoCo(std::vector<at::Tensor> parameters, c10::intrusive_ptr<c10d::ProcessGroup> group,
         CodecSpec codec = Q4{}, DiLoCoOptions options = {});
  DiLoCo(const torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group,
         CodecSpec codec = Q4{}, DiLoCoOptions options = {});
  ~DiLoCo();
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  // After each inner optimizer step: counts it and syncs the fragments due (returns how many).
  int step();
  // overlap_steps > 0: waits for the round in flight and merges it now (the end of training).
  bool flush();
  OuterSyncStats stats() const;
  // This rank's counters in Prometheus's text format, front_end="diloco": a round counts as one
  // bucket (gradcomp_buckets_total), an inner step as a step, a diverged round as a non-finite
  // bucket. write_metrics writes them atomically (node_exporter's textfile collector).
  std::string metrics_text() const;
  void write_metrics(const std::string& path) const;
  // The parameter positions of each fragment, in order.
  std::vector<std::vector<int64_t>> fragments() const;
  int rank() const;
  int world_size() const;

  // Anchors, momenta, round counters and the allreduce's residuals (each rank saves its own; the
  // model and inner optimizer are saved by the program, as usual).
  OuterSyncState state() const;
  void load_state(const OuterSyncState& state);
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The weight all-gather for programs that shard their own parameters (ZeRO-3 style): each
// rank's shard travels as block-scaled int8 (or 4-bit) (gradcomp::CompressedAllGather) and every
// rank decodes every shard, its own included, so all ranks compute with the same weights while each
// keeps its exact shard for the optimizer:
//
//   gradcomp::WeightAllGather gather(group);
//   gather.all_gather(full_weights, my_shard, "layer3");  // full: world * shard.numel() elements
//
// float32, bfloat16 or float16 tensors on the CPU, or on CUDA with the v2 kernels
// (GRADCOMP_KERNELS=v2; under v1 the first CUDA call is refused naming it): the collective of
// gradcomp.torch.fsdp(params=gradcomp.Int8()), the same code. On CUDA the work is queued on the
// stream current at the first call, which every later call must use (another is refused by name):
// encode, the group's all-gather and decode follow each other on it without the host waiting, and
// the call returns after one small read of the payloads' verdicts at its end (so that a refusal
// raises inside the call that was refused, before the output is used); the output is ready in
// that stream's order. A shard holding NaN or infinity on any rank makes every rank throw, naming
// `name` and the rank, with no row written. AllGatherOptions::codec = WeightCodec::kInt4 sends
// 4-bit rows instead (GCW4, docs/format.md); on CUDA both codecs need the v2 kernels
// (GRADCOMP_KERNELS=v2, refused by name otherwise). Each name keeps its own buffers and layout
// for the object's life (agreed across ranks at its first call, 32 bytes to each rank): use a
// fixed set of names, first called in the same order on every rank, not a new name per step.
class WeightAllGather {
 public:
  explicit WeightAllGather(c10::intrusive_ptr<c10d::ProcessGroup> group,
                           AllGatherOptions options = {},
                           std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  ~WeightAllGather();
  WeightAllGather(const WeightAllGather&) = delete;
  WeightAllGather& operator=(const WeightAllGather&) = delete;

  // output: world_size rows of input.numel() elements of input's dtype; input may be output's
  // row rank(). `name` is the tensor's key: every name has its own bucket, whose layout the ranks
  // agree on at its first call (shards of different sizes go through one object under different
  // names), and errors name it and "WeightAllGather".
  void all_gather(const at::Tensor& output, const at::Tensor& input,
                  const std::string& name = "parameters");
  // Since construction: bytes this rank sent, and seconds spent in the calls outside the
  // transport (encoding, checking and decoding; on CUDA, queueing them and the verdict read).
  uint64_t bytes_sent() const;
  double codec_seconds() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};
// The name this class had while int8 was the only weight codec.
using Int8AllGather [[deprecated("use gradcomp::WeightAllGather")]] = WeightAllGather;

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const DiLoCo& diloco);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, DiLoCo& diloco);

}  // namespace gradcomp
