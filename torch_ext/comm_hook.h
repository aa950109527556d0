// The DDP communication hook: a c10d::CommHookInterface running gradcomp's compressed allreduce.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <unordered_map>
#include <vector>

#include "gradcomp/gradcomp.h"

namespace gradcomp {
namespace torch_ext {

// Options a Python codec spec turns into (gradcomp.Q4 / TopK / NoCompression).
struct HookOptions {
  bool compress = true;  // false: plain allreduce through the same path (A/B runs)
  CompressionConfig config;
};

// Counters for one step or for the whole run.
struct HookStats {
  uint64_t buckets = 0;
  uint64_t bytes_sent = 0;
  uint64_t uncompressed_bytes = 0;  // what a ring allreduce of the bucket dtype would send
  double codec_seconds = 0;         // encode + decode (the job's time outside the collectives)
  double comm_seconds = 0;
  uint64_t nonfinite_buckets = 0;
};

// A stable bucket identity: the same parameters in the same bucket give the same value on every
// rank and across restarts (DDP rebuilds its buckets after the first iteration).
uint64_t bucket_identity(int64_t index, int64_t numel, at::ScalarType dtype,
                         const std::vector<std::vector<int64_t>>& param_shapes);

class ProcessGroupCommunicator;

// Shared by the C++ hook the reducer owns and the Python handle: codec state, the worker thread
// that runs CPU buckets off the autograd thread, and statistics.
class HookCore {
 public:
  HookCore(c10::intrusive_ptr<c10d::ProcessGroup> group, HookOptions options);
  ~HookCore();

  // Where one parameter's gradient lies in a bucket: its position among the model's
  // parameters (set_parameters), element offset and count.
  struct ParamSlice {
    int64_t param;
    int64_t offset;
    int64_t numel;
  };
  // A bucket's parameters in order, as a checkpoint records them.
  struct BucketLayout {
    int64_t index = 0;
    int dtype = 0;
    std::vector<std::pair<int64_t, int64_t>> params;  // (parameter position, numel)
  };

  // The DDP model's parameters in order (the register route): buckets are then recorded by
  // parameter, so the first step after a restart can reduce the layout the checkpoint saved.
  void set_parameters(const std::vector<at::Tensor>& params);
  int64_t param_index(const at::Tensor& param) const;  // -1: not one of them

  // Queues one bucket; the future completes with the averaged bucket (written in place).
  // is_last marks the step's last bucket.
  c10::intrusive_ptr<c10::ivalue::Future> submit(at::Tensor bucket, int64_t index,
                                                 uint64_t identity, bool is_last,
                                                 std::vector<ParamSlice> params = {});
  // Averages one bucket on the calling thread. CPU buckets are done on return; CUDA buckets are
  // queued on the current stream (the hook's compression stream) and done when it gets there.
  // Returns false when the bucket is held back until the step's last bucket (the first step
  // after a restart whose buckets differ from the saved ones); `future` then completes later.
  bool reduce(at::Tensor bucket, int64_t index, uint64_t identity, bool is_last,
              const std::vector<ParamSlice>& params = {},
              const c10::intrusive_ptr<c10::ivalue::Future>& future = {});

  HookStats last_step_stats() const;
  HookStats total_stats() const;
  int world_size() const;

  CompressionState state() const;
  std::map<uint64_t, BucketLayout> layouts() const;
  void load_state(const CompressionState& state, bool started,
                  std::map<uint64_t, BucketLayout> layouts = {});
  bool started() const;

 private:
  struct Job {
    at::Tensor bucket;
    int64_t index;
    uint64_t identity;
    bool is_last;
    std::vector<ParamSlice> params;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    // The submitting thread's profiler state (record-function callbacks and debug info), so
    // phases run on the worker show in its trace. Only these two: the full ThreadLocalState
    // also carries Python-object state whose copies need the GIL.
    at::RecordFunctionTLS record_function_tls;
    std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info;
  };
  struct Held {
    at::Tensor bucket;
    uint64_t identity;
    std::vector<ParamSlice> params;
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };
  void reduce_segments(CompressedAllreduce* engine, const std::vector<Segment>& segments,
                       DType dtype, int64_t numel, size_t element_size, uint64_t identity,
                       bool queued);
  void reduce_restored_layouts(CompressedAllreduce* engine, const std::vector<Held>& held,
                               bool queued);
  void end_step(CompressedAllreduce* engine);
  void add_stats(const HookStats& delta);
  void worker_loop();
  CompressedAllreduce& engine_for(const at::Tensor& bucket);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  HookOptions options_;
  std::unique_ptr<Backend> cpu_backend_;    // this hook's own, so no other caller shares its flags
  c10::optional<c10::Stream> cuda_stream_;  // the compression stream, chosen at the first bucket
  std::unique_ptr<ProcessGroupCommunicator> comm_;
  std::unique_ptr<CompressedAllreduce> engine_;
  mutable std::mutex state_mu_;  // engine, stats, step boundaries
  bool started_ = false;
  HookStats step_stats_, last_step_, total_;
  // Bucket identities of the step in progress and of the last complete one: when they differ
  // (DDP rebuilt its buckets), the buckets no longer used are released.
  std::set<uint64_t> step_ids_, last_step_ids_;
  // Its own lock: runHook looks parameters up on the autograd thread while the worker holds
  // state_mu_ for a whole reduction.
  mutable std::mutex params_mu_;
  std::unordered_map<const c10::TensorImpl*, int64_t> param_index_;
  std::map<uint64_t, BucketLayout> layouts_;   // buckets in use, by identity
  std::map<uint64_t, BucketLayout> restored_;  // from load_state, until the next step starts
  bool restoring_ = false;                     // this step's buckets are held back
  std::vector<Held> held_;
  std::unique_ptr<CompressionState> pending_state_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

// What DDP's reducer owns: forwards each bucket to the shared HookCore.
class GradcompCommHook final : public c10d::CommHookInterface {
 public:
  explicit GradcompCommHook(std::shared_ptr<HookCore> core) : core_(std::move(core)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;

 private:
  std::shared_ptr<HookCore> core_;
};

}  // namespace torch_ext
}  // namespace gradcomp
