// The per-step bucket engine every front end drives (the DDP hook, GradSync): steps, scheduling,
// bucket layouts and their remapping after a restart, residual lifecycle, stats, checkpoints.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gradcomp/collectives.h"

namespace gradcomp {

// Where one parameter's gradient lies in a bucket: its position among the model's parameters,
// and its element offset and count in the bucket.
struct ParamSlice {
  int64_t param = 0;
  int64_t offset = 0;
  int64_t numel = 0;
};

// A bucket's parameters in order, as a checkpoint records them.
struct BucketLayout {
  int64_t index = 0;
  DType dtype = DType::kFloat32;
  std::vector<std::pair<int64_t, int64_t>> params;  // (parameter position, numel)
};

// One bucket of the current step, handed to the engine by a front end.
struct BucketRequest {
  void* data = nullptr;  // numel contiguous elements of dtype, in the backend's memory
  int64_t numel = 0;
  DType dtype = DType::kFloat32;
  int64_t index = 0;  // position in the step: buckets come in index order, 0 starts a step
  uint64_t identity = 0;
  bool is_last = false;
  std::vector<ParamSlice> params;  // empty when the front end does not know the parameters
};

// Counters for one step or for a whole run.
struct ReductionStats {
  uint64_t buckets = 0;
  // Buckets that went through the codec (the rest: plain allreduce, NoCompression). At one rank
  // nothing goes on a wire, so bytes_sent and uncompressed_bytes stay 0 while the codec still runs.
  uint64_t compressed_buckets = 0;
  uint64_t bytes_sent = 0;          // everything this rank put on the wire
  uint64_t inter_node_bytes = 0;    // the part that left its node (flat: all of it, as a bound)
  uint64_t uncompressed_bytes = 0;  // what a ring allreduce of the bucket dtype would send
  double codec_seconds = 0;         // encode + decode: the time outside the collectives
  double comm_seconds = 0;
  uint64_t nonfinite_buckets = 0;
  // Buckets finished after the next one was begun (overlapped buckets: the next one's encode ran
  // during their last collectives, and their decode during its collectives).
  uint64_t overlapped_buckets = 0;
  uint64_t max_queued = 0;  // most buckets waiting for the worker at once (a gauge, not a sum)
  uint64_t steps = 0;       // steps begun
  // Buckets whose reduction ended before the step's last bucket was handed in: on the host
  // clock, their communication ran during backward (CUDA: their queueing did).
  uint64_t buckets_in_backward = 0;
  uint64_t failed_buckets = 0;     // buckets whose reduction raised
  uint64_t failed_steps = 0;       // steps with a failed bucket (undone when the next begins)
  uint64_t rejected_payloads = 0;  // failures whose cause was a payload failing its checks
  uint64_t residual_bytes = 0;     // a gauge: the memory of residuals and velocities now
  // Seconds from a bucket's start to its end (CUDA: to its queueing), as a histogram: counts of
  // buckets at most kLatencyBounds[i] seconds, and above the last bound.
  static constexpr int kLatencyBuckets = 16;
  static constexpr double kLatencyBounds[kLatencyBuckets] = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
  uint64_t latency_counts[kLatencyBuckets + 1] = {};
  double latency_seconds = 0;  // their sum
  void observe_latency(double seconds);
  void add(const ReductionStats& other);
};

// Labels of one rank's metrics.
struct MetricLabels {
  int rank = 0;
  int local_rank = 0;
  std::string node;       // the host name
  std::string codec;      // q4, topk, none
  std::string front_end;  // ddp, fsdp, gradsync
};

// Labels for this process: `rank`, the local rank from LOCAL_RANK (torchrun) or SLURM_LOCALID
// (srun), else 0, and the host name.
MetricLabels metric_labels(int rank, std::string codec, std::string front_end);

// A rank's counters in the Prometheus text exposition format (version 0.0.4), gradcomp_* names,
// one `_total` counter per count, `_seconds` and `_bytes` units, the latency histogram as
// gradcomp_bucket_seconds. docs/operations.md lists them.
std::string prometheus_text(const ReductionStats& total, const MetricLabels& labels);
// The same text followed by the parameter all-gathers' series of their own (FSDP's int8 weights),
// gradcomp_weight_*: the gradient series above never count them, so that a gradient compression
// ratio or byte rate means the same with and without quantized weights. `weights.steps` is not
// exported (steps are the gradients' gradcomp_steps_total).
std::string prometheus_text(const ReductionStats& gradients, const ReductionStats& weights,
                            const MetricLabels& labels);
// Writes `text` to `path` through a temporary file of a unique name in the same directory (created
// with O_EXCL | O_NOFOLLOW), fsynced, renamed over `path`, and the directory fsynced: a reader
// (node_exporter's textfile collector) never sees half of it, concurrent writers do not share a
// temporary, and a crash leaves the old file or the new one. Throws Error naming the path.
void write_file_atomically(const std::string& path, const std::string& text);

// When one bucket was handed in, began reducing and was done (host clock; on a CUDA backend the
// reduction is only queued in that time). Front ends compare it with their backward pass.
struct BucketTiming {
  int64_t index = 0;
  std::chrono::steady_clock::time_point submitted, started, finished;
};

// What a rank checkpoints for a bit-identical resume.
struct EngineState {
  CompressionState compression;
  bool started = false;                      // a step has run (the next bucket 0 starts another)
  int world_size = 0;                        // of the job that saved it; 0: not recorded
  int local_world_size = 0;                  // its ranks per node (1: flat); 0: not recorded
  std::map<uint64_t, BucketLayout> layouts;  // buckets with residuals, by identity
};

// EngineState as bytes (versioned and checksummed), for front ends that checkpoint without
// Python; parse_engine_state checks every field and throws Error saying what is wrong.
std::vector<uint8_t> serialize_engine_state(const EngineState& state);
EngineState parse_engine_state(const uint8_t* data, size_t size);

struct EngineOptions {
  bool compress = true;  // false: a plain averaging allreduce through the same path (A/B runs)
  CompressionConfig config;
  // The job's world size when known before bind() (a front end that has its process group):
  // load_state then refuses a checkpoint of another world size at once.
  int world_size = 0;
  // Ranks per node when known before bind(): 1 (or 0) is the flat scheme; more needs the
  // NodeGroups at bind() (collectives.h) and a world size it divides.
  int local_world_size = 0;
  // Called on the thread that hands a bucket in; returns what the reducing thread runs. A front
  // end carries its thread context this way (the torch layer: the profiler's state and a range).
  std::function<std::function<void()>(std::function<void()>)> wrap_task;
  // The same for the collectives a reduction hands to its own thread (pieces of two-phase q4),
  // without wrap_task's range.
  std::function<std::function<void()>(std::function<void()>)> carry_context;
  // The CPUs of the worker thread (host memory) and of the collectives threads it starts:
  // "inherit" keeps the mask of the thread that calls bind(); a list such as "2,5-7" sets it;
  // "auto" inherits it, unless OpenMP bound that thread to one core (OMP_PROC_BIND, OMP_PLACES,
  // GOMP_CPU_AFFINITY, KMP_AFFINITY), which would make the codec share backward's core: then
  // the worker may also run on every CPU of the process's cpuset and that core's NUMA node that
  // no thread is bound to.
  std::string worker_cpus = "auto";
};

// Throws Error when `spec` is not a worker_cpus value ("auto", "inherit", a list like "0,2-3").
void check_worker_cpus(const std::string& spec);

// A bucket identity that is the same on every rank and across restarts: the bucket's position,
// size, dtype and its parameters' shapes.
uint64_t bucket_identity(int64_t index, int64_t numel, DType dtype,
                         const std::vector<std::vector<int64_t>>& param_shapes);

// Averages a step's buckets over the ranks, one at a time in index order. On host memory the
// reductions run on a worker thread of the engine, so the thread handing buckets in (autograd)
// never waits for them; on a CUDA backend they are queued in stream order on the calling thread
// and nothing waits for the device. A bucket that fails fails its step: when the next step
// starts, the residuals of the step's other buckets are put back and the step counter stays, so
// a job that catches the error and redoes the step computes what the step would have.
class BucketEngine {
 public:
  // Runs once per bucket, on the thread that reduced it: null, or the error that stopped it.
  using Done = std::function<void(std::exception_ptr)>;

  explicit BucketEngine(EngineOptions options);
  // Finishes the buckets already queued, then stops the worker.
  ~BucketEngine();
  BucketEngine(const BucketEngine&) = delete;
  BucketEngine& operator=(const BucketEngine&) = delete;

  // The transport and backend, once, before the first bucket (front ends learn the device from
  // it). `backend` may be null when options.compress is false. With node groups (more than one
  // rank per node) the compressed reductions are hierarchical; `comm` (all ranks) carries the
  // uncompressed path.
  void bind(Communicator& comm, Backend* backend, NodeGroups groups = {});
  bool bound() const;

  // Queues a bucket for the worker thread (host memory) or reduces it at once (CUDA); `done`
  // runs once it is averaged in place (CUDA: queued in stream order).
  void submit(BucketRequest bucket, Done done);
  // Reduces a bucket on the calling thread. Without `done` errors are thrown and the bucket is
  // averaged on return. With `done` the bucket may be held back until the step's last bucket
  // (the first step after load_state, when the buckets differ from the checkpoint's) and `done`
  // reports its end, errors included.
  void reduce(const BucketRequest& bucket, Done done = {});

  ReductionStats last_step_stats() const;  // the step in progress, or the last one
  ReductionStats total_stats() const;
  std::vector<BucketTiming> step_timeline() const;  // the step in progress, or the last one
  EngineState state() const;
  // The CPUs the worker thread may run on (empty without a worker: CUDA, or before bind()), and
  // how options.worker_cpus chose them.
  std::vector<int> worker_cpus() const;
  std::string worker_placement() const;
  // Replaces the state as a whole, after checking it (seed, world size, residual sizes against the
  // recorded layouts); the next step reduces the saved bucket layouts when its buckets differ.
  void load_state(EngineState state);
  bool started() const;

 private:
  struct Held {
    BucketRequest bucket;
    Done done;
  };
  // A bucket begun and left in flight while the worker begins the next one (overlapped buckets):
  // its decode and completion come with the next bucket's reduction.
  struct InFlight {
    BucketRequest bucket;
    Done done;
    BucketTiming timing;
  };
  // The counters a reduction's stats are the difference of.
  struct Mark {
    uint64_t bytes = 0, inter_node_bytes = 0;
    double comm_seconds = 0, blocked_seconds = 0;
    std::chrono::steady_clock::time_point at;
  };
  using Completions = std::vector<std::pair<Done, std::exception_ptr>>;

  // `worker`: called by the worker thread, which may leave the bucket in flight.
  void reduce_now(const BucketRequest& bucket, Done done,
                  std::chrono::steady_clock::time_point submitted, bool worker);
  // Adds the buckets whose `done` must run once the lock is released to `completions`; throws
  // the error of `bucket` itself.
  void reduce_locked(const BucketRequest& bucket, Done done, BucketTiming timing, bool worker,
                     Completions& completions);
  void reduce_overlapped(const BucketRequest& bucket, Done done, BucketTiming timing,
                         Completions& completions);
  // Decodes the oldest begun bucket; returns its completion.
  std::pair<Done, std::exception_ptr> finish_bucket(const BucketRequest& bucket, Done done,
                                                    BucketTiming timing);
  // Finishes the bucket in flight, if any (the worker, when nothing else is queued).
  void settle_in_flight();
  // The error fail_bucket would throw, as a value.
  std::exception_ptr failure(const BucketRequest& b, const std::exception& e);
  Mark mark() const;
  // Adds what happened since `from` to `delta` and the stats (the time, as codec time, only with
  // `codec_time`); returns where it left off.
  Mark charge(const Mark& from, ReductionStats delta, bool codec_time = true);
  void record_timing(BucketTiming timing);
  void begin_step();
  void check_state(const EngineState& state) const;
  [[noreturn]] void fail_bucket(const BucketRequest& b, const std::exception& e);
  void reduce_segments(const std::vector<Segment>& segments, DType dtype, int64_t numel,
                       uint64_t identity);
  void reduce_restored_layouts(const std::vector<Held>& held);
  void end_step();
  void add_stats(const ReductionStats& delta);
  void worker_loop();
  std::function<void()> wrapped(std::function<void()> task) const;

  EngineOptions options_;
  Communicator* comm_ = nullptr;
  NodeGroups groups_;  // both null: flat
  Backend* backend_ = nullptr;
  bool queued_ = false;  // CUDA: reductions are queued in stream order on the calling thread
  // Set last by bind(): submit() reads it without the state lock, which the worker holds for a
  // whole reduction.
  std::atomic<bool> bound_{false};
  std::unique_ptr<CompressedAllreduce> allreduce_;  // set by bind() under stats_mu_ too

  mutable std::mutex state_mu_;  // everything below up to the queue
  EngineState pending_;          // loaded before bind()
  bool started_ = false;
  // Bucket identities of the step in progress and of the last complete one: when they differ
  // (the front end rebuilt its buckets), the buckets no longer used are released.
  std::set<uint64_t> step_ids_, last_step_ids_;
  bool step_failed_ = false;
  std::vector<uint64_t> reduced_this_step_;    // completed buckets of the step, for a rollback
  std::map<uint64_t, BucketLayout> layouts_;   // buckets in use, by identity
  std::map<uint64_t, BucketLayout> restored_;  // from load_state, until the next step starts
  bool restoring_ = false;                     // this step's buckets are held back
  std::vector<Held> held_;
  std::optional<InFlight> in_flight_;
  Mark cursor_;  // where the stats left off when in_flight_ was begun

  // Taken after the state lock, never held for long: stats are read while a reduction runs.
  mutable std::mutex stats_mu_;
  ReductionStats step_stats_, last_step_, total_;
  std::vector<BucketTiming> timeline_, last_timeline_;

  mutable std::mutex queue_mu_;  // the queue and its high-water marks; taken last
  std::condition_variable queue_cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t max_queued_step_ = 0, max_queued_total_ = 0;
  bool stopping_ = false;
  std::thread worker_;
  std::vector<int> worker_cpus_;  // set by bind() under stats_mu_
  std::string worker_placement_;
};

}  // namespace gradcomp
