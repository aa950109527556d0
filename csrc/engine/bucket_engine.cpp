// The bucket engine: step boundaries, the worker thread, stats, the release of buckets a front
// end stopped using, and checkpoints.
#if defined(__linux__)
#include <pthread.h>
#endif

#include <algorithm>
#include <chrono>
#include <iomanip>

#include "gradcomp/engine.h"
#include "worker_cpus.h"

namespace gradcomp {

void ReductionStats::add(const ReductionStats& o) {
  buckets += o.buckets;
  compressed_buckets += o.compressed_buckets;
  bytes_sent += o.bytes_sent;
  inter_node_bytes += o.inter_node_bytes;
  uncompressed_bytes += o.uncompressed_bytes;
  codec_seconds += o.codec_seconds;
  comm_seconds += o.comm_seconds;
  nonfinite_buckets += o.nonfinite_buckets;
  overlapped_buckets += o.overlapped_buckets;
  max_queued = std::max(max_queued, o.max_queued);
  steps += o.steps;
  buckets_in_backward += o.buckets_in_backward;
  failed_buckets += o.failed_buckets;
  failed_steps += o.failed_steps;
  rejected_payloads += o.rejected_payloads;
  residual_bytes = std::max(residual_bytes, o.residual_bytes);
  for (int i = 0; i <= kLatencyBuckets; ++i) latency_counts[i] += o.latency_counts[i];
  latency_seconds += o.latency_seconds;
}

void ReductionStats::observe_latency(double seconds) {
  int i = 0;
  while (i < kLatencyBuckets && seconds > kLatencyBounds[i]) ++i;
  ++latency_counts[i];
  latency_seconds += seconds;
}

namespace {

void check_same_world(int saved, int job) {
  GRADCOMP_CHECK(saved == 0 || job == 0 || saved == job,
                 "the gradcomp state was saved by a job of "
                     << saved << " ranks; this job has " << job
                     << ": residuals belong to one rank of one world size and are not "
                        "redistributed (load it into a job of "
                     << saved << " ranks, or start without it)");
}

// 0 and 1 both mean flat when a job knows its topology; 0 in a state: not recorded.
void check_same_local_world(int saved, int job) {
  GRADCOMP_CHECK(saved == 0 || std::max(saved, 1) == std::max(job, 1),
                 "the gradcomp state was saved by a job of "
                     << saved << " ranks per node; this job has " << std::max(job, 1)
                     << ": residuals belong to one rank's shard of each bucket (load it with "
                     << saved << " ranks per node, or start without it)");
}

// A reduction's communication counters, summed over the transports it uses.
struct CommCounters {
  uint64_t bytes = 0, inter_node_bytes = 0;
  double seconds = 0;
};

CommCounters counters(Communicator& comm, const NodeGroups& groups) {
  CommCounters c;
  c.bytes = comm.bytes_sent();
  c.seconds = comm.seconds();
  c.inter_node_bytes = c.bytes;
  if (groups.intra_node != nullptr) {
    c.inter_node_bytes = groups.inter_node->bytes_sent();
    c.bytes += groups.intra_node->bytes_sent() + groups.inter_node->bytes_sent();
    c.seconds += groups.intra_node->seconds() + groups.inter_node->seconds();
  }
  return c;
}

}  // namespace

uint64_t bucket_identity(int64_t index, int64_t numel, DType dtype,
                         const std::vector<std::vector<int64_t>>& param_shapes) {
  // c10::ScalarType's codes for the three dtypes: identities were first computed from them, and
  // checkpoints and random streams (Philox is keyed by the identity's low 32 bits) carry them.
  const uint64_t dtype_tag = dtype == DType::kFloat32 ? 6 : (dtype == DType::kFloat16 ? 5 : 15);
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xFF;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(index));
  mix(static_cast<uint64_t>(numel));
  mix(dtype_tag);
  for (const auto& shape : param_shapes) {
    mix(shape.size());
    for (int64_t d : shape) mix(static_cast<uint64_t>(d));
  }
  return h;
}

void check_worker_cpus(const std::string& spec) {
  detail::parse_cpu_request(spec);
}

BucketEngine::BucketEngine(EngineOptions options) : options_(std::move(options)) {
  if (options_.compress) options_.config.validate();
  check_worker_cpus(options_.worker_cpus);
  pending_.compression.seed = options_.config.seed;
  pending_.world_size = options_.world_size;
  pending_.local_world_size = options_.local_world_size;
}

BucketEngine::~BucketEngine() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void BucketEngine::bind(Communicator& comm, Backend* backend, NodeGroups groups) {
  std::lock_guard<std::mutex> lock(state_mu_);
  GRADCOMP_CHECK(comm_ == nullptr, "the bucket engine is already bound to a transport");
  const bool queued = backend != nullptr ? backend->is_cuda() : comm.device_memory();
  std::string placement = "no worker thread: CUDA buckets are queued in stream order";
  const std::vector<int> cpus =
      queued ? std::vector<int>{}
             : detail::place_worker(detail::parse_cpu_request(options_.worker_cpus), &placement);
  const std::vector<int> worker_cpus =
      queued ? std::vector<int>{} : (cpus.empty() ? detail::current_thread_cpus() : cpus);
  // The worker started below inherits these CPUs; a mask the kernel refuses throws here, before
  // anything is bound.
  detail::ScopedThreadCpus on_worker_cpus(cpus);
  GRADCOMP_CHECK(backend != nullptr || !options_.compress,
                 "a compressing bucket engine needs a backend");
  check_same_world(pending_.world_size, comm.world_size());
  GRADCOMP_CHECK((groups.intra_node == nullptr) == (groups.inter_node == nullptr),
                 "node groups need both the intra-node and the inter-node communicator");
  const int local = groups.intra_node != nullptr ? groups.intra_node->world_size() : 1;
  if (groups.intra_node != nullptr) {
    GRADCOMP_CHECK(local * groups.inter_node->world_size() == comm.world_size() &&
                       groups.inter_node->rank() * local + groups.intra_node->rank() == comm.rank(),
                   "node groups of "
                       << local << " ranks per node and " << groups.inter_node->world_size()
                       << " nodes do not place rank " << comm.rank() << " of " << comm.world_size()
                       << " (ranks must be node-major)");
  }
  GRADCOMP_CHECK(std::max(options_.local_world_size, 1) == local,
                 "the engine was configured for " << options_.local_world_size
                                                  << " ranks per node but bound to " << local);
  check_same_local_world(pending_.local_world_size, local);
  if (options_.compress) {
    // One rank per node is the flat scheme: over `comm`, whose counters the stats read.
    auto allreduce = local > 1
                         ? std::make_unique<CompressedAllreduce>(groups, *backend, options_.config)
                         : std::make_unique<CompressedAllreduce>(comm, *backend, options_.config);
    allreduce->set_context_carrier(options_.carry_context);
    allreduce->load_state(pending_.compression);
    // The stats read it under their own lock alone: a metrics scrape may run while the first
    // bucket binds the engine (the DDP hook binds there, with the GIL released).
    std::lock_guard<std::mutex> stats_lock(stats_mu_);
    allreduce_ = std::move(allreduce);
  }
  if (local > 1) groups_ = groups;
  pending_.local_world_size = local;
  comm_ = &comm;
  backend_ = backend;
  queued_ = queued;
  if (!queued_) worker_ = std::thread([this] { worker_loop(); });
  {
    std::lock_guard<std::mutex> stats_lock(stats_mu_);
    worker_placement_ = placement;
    worker_cpus_ = worker_cpus;
  }
  bound_ = true;
}

bool BucketEngine::bound() const {
  return bound_;
}

std::vector<int> BucketEngine::worker_cpus() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return worker_cpus_;
}

std::string BucketEngine::worker_placement() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return worker_placement_;
}

std::function<void()> BucketEngine::wrapped(std::function<void()> task) const {
  return options_.wrap_task ? options_.wrap_task(std::move(task)) : std::move(task);
}

void BucketEngine::submit(BucketRequest bucket, Done done) {
  GRADCOMP_CHECK(done, "BucketEngine::submit needs a completion callback");
  GRADCOMP_CHECK(bound(), "bucket " << bucket.index << " was submitted before bind()");
  if (queued_) return reduce(bucket, std::move(done));
  std::function<void()> task = wrapped([this, bucket = std::move(bucket), done = std::move(done),
                                        submitted = std::chrono::steady_clock::now()] {
    reduce_now(bucket, done, submitted, true);
  });
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_.push_back(std::move(task));
    // Kept under the queue's lock, not the state's: the worker holds that one for a whole
    // reduction, and backward must not wait for it here.
    max_queued_step_ = std::max<uint64_t>(max_queued_step_, queue_.size());
    max_queued_total_ = std::max<uint64_t>(max_queued_total_, queue_.size());
  }
  queue_cv_.notify_one();
}

void BucketEngine::reduce(const BucketRequest& bucket, Done done) {
  const auto submitted = std::chrono::steady_clock::now();
  wrapped([&] { reduce_now(bucket, done, submitted, false); })();
}

void BucketEngine::worker_loop() {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), "gradcomp-worker");  // for top, gdb and leak checks
#endif
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    // A task reports its errors through its callback; one that escapes (a callback that threw)
    // must not end the process.
    try {
      task();
    } catch (...) {
    }
    bool idle;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      idle = queue_.empty();
    }
    // A bucket is left in flight only while another is queued, whose task finishes it; one
    // whose task did not reach the engine must not wait for a bucket that may never come.
    if (idle) settle_in_flight();
  }
}

void BucketEngine::settle_in_flight() {
  std::pair<Done, std::exception_ptr> completion;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!in_flight_) return;
    InFlight f = std::move(*in_flight_);
    in_flight_.reset();
    completion = finish_bucket(f.bucket, std::move(f.done), f.timing);
  }
  try {
    completion.first(std::move(completion.second));
  } catch (...) {
  }
}

void BucketEngine::reduce_now(const BucketRequest& bucket, Done done,
                              std::chrono::steady_clock::time_point submitted, bool worker) {
  // Filled as buckets end, so a bucket in flight that ended before an error below still
  // completes.
  Completions completions;
  std::exception_ptr error;
  try {
    std::lock_guard<std::mutex> lock(state_mu_);
    BucketTiming timing;
    timing.index = bucket.index;
    timing.submitted = submitted;
    timing.started = std::chrono::steady_clock::now();
    reduce_locked(bucket, done, timing, worker, completions);
  } catch (...) {
    error = std::current_exception();
  }
  // Outside the lock: a callback may hand the next bucket in. One that throws must not keep the
  // others (an earlier bucket's and this one's) from completing.
  // Each callback gets the engine's own reference to its error, not a copy: the callback may hand
  // the error to another thread, and a copy the worker dropped afterwards would be ordered after
  // that thread's reads only by libstdc++'s reference count, which ThreadSanitizer cannot see.
  for (auto& [callback, failed] : completions) {
    try {
      callback(std::move(failed));
    } catch (...) {
    }
  }
  if (!error) return;
  if (!done) std::rethrow_exception(error);
  done(std::move(error));
}

void BucketEngine::record_timing(BucketTiming timing) {
  timing.finished = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(timing.finished - timing.started).count();
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  timeline_.push_back(timing);
  step_stats_.observe_latency(seconds);
  total_.observe_latency(seconds);
}

std::exception_ptr BucketEngine::failure(const BucketRequest& b, const std::exception& e) {
  try {
    fail_bucket(b, e);
  } catch (...) {
    return std::current_exception();
  }
}

void BucketEngine::reduce_locked(const BucketRequest& b, Done done, BucketTiming timing,
                                 bool worker, Completions& completions) {
  GRADCOMP_CHECK(comm_ != nullptr, "bucket " << b.index << " reached the engine before bind()");
  const bool overlap = worker && allreduce_ && allreduce_->overlaps_buckets();
  // Overlap stays inside a step, and only the worker's reductions overlap.
  if (in_flight_ && (b.index == 0 || !overlap)) {
    InFlight f = std::move(*in_flight_);
    in_flight_.reset();
    completions.push_back(finish_bucket(f.bucket, std::move(f.done), f.timing));
  }
  if (b.index == 0) {
    if (started_) begin_step();
    ReductionStats begun;
    begun.steps = 1;
    add_stats(begun);
  }
  started_ = true;
  if (!b.params.empty()) {
    BucketLayout layout;
    layout.index = b.index;
    layout.dtype = b.dtype;
    for (const ParamSlice& p : b.params) layout.params.emplace_back(p.param, p.numel);
    layouts_[b.identity] = std::move(layout);
  }

  // The first step after load_state: a front end's first buckets can differ from the ones the
  // checkpoint saved (DDP builds its first-iteration buckets in parameter order and rebuilds them
  // in gradient order). Then this step's buckets are held back and, at the last one, the saved
  // buckets are reduced as segment lists over them, exactly as the run that saved them would
  // have; DDP waits for its futures only after handing over its last bucket.
  if (!restored_.empty() && !restoring_ && held_.empty()) {
    restoring_ = allreduce_ && !b.params.empty() && done && restored_.count(b.identity) == 0;
    if (!restoring_) restored_.clear();
  }
  if (restoring_) {
    GRADCOMP_CHECK(done, "bucket " << b.index << " has no completion callback, but the engine is "
                                   << "holding this step's buckets to reduce the saved layouts");
    held_.push_back(Held{b, std::move(done)});
    record_timing(timing);
    if (!b.is_last) return;
    std::vector<Held> held = std::move(held_);
    held_.clear();
    restoring_ = false;
    std::exception_ptr error;
    try {
      try {
        reduce_restored_layouts(held);
      } catch (const std::exception& e) {
        fail_bucket(b, e);
      }
      end_step();
    } catch (...) {
      error = std::current_exception();
    }
    restored_.clear();
    for (Held& h : held) completions.emplace_back(std::move(h.done), error);
    return;
  }

  if (overlap) return reduce_overlapped(b, std::move(done), timing, completions);
  try {
    if (allreduce_) {
      reduce_segments({Segment{b.data, 0, b.numel}}, b.dtype, b.numel, b.identity);
    } else {
      const uint64_t sent0 = comm_->bytes_sent();
      const double comm0 = comm_->seconds();
      comm_->allreduce_mean(b.data, b.numel, b.dtype);
      ReductionStats delta;
      delta.buckets = 1;
      delta.bytes_sent = comm_->bytes_sent() - sent0;
      delta.inter_node_bytes = delta.bytes_sent;
      delta.uncompressed_bytes = ring_allreduce_bytes(b.numel, b.dtype, comm_->world_size());
      delta.comm_seconds = comm_->seconds() - comm0;
      add_stats(delta);
    }
  } catch (const std::exception& e) {
    fail_bucket(b, e);
  }
  step_ids_.insert(b.identity);
  if (b.is_last) end_step();
  record_timing(timing);
  if (done) completions.emplace_back(std::move(done), nullptr);
}

void BucketEngine::reduce_overlapped(const BucketRequest& b, Done done, BucketTiming timing,
                                     Completions& completions) {
  // Where the stats left off: at the bucket in flight, whose collectives ran meanwhile (what
  // they did since is charged first, without the time: callbacks and waits are not codec work).
  const Mark from = in_flight_ ? charge(cursor_, ReductionStats{}, false) : mark();
  std::exception_ptr error;
  try {
    const Segment whole{b.data, 0, b.numel};
    allreduce_->begin_allreduce(&whole, 1, b.dtype, b.identity);
  } catch (const std::exception& e) {
    error = failure(b, e);
  }
  cursor_ = charge(from, ReductionStats{});
  // The earlier bucket's decode, now that this one's encodes are done and its collectives queued
  // behind the earlier one's.
  if (in_flight_) {
    InFlight f = std::move(*in_flight_);
    in_flight_.reset();
    ReductionStats overlapped;
    overlapped.overlapped_buckets = 1;
    add_stats(overlapped);
    completions.push_back(finish_bucket(f.bucket, std::move(f.done), f.timing));
  }
  if (error) {
    completions.emplace_back(std::move(done), error);
    return;
  }
  bool queued;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queued = !queue_.empty();
  }
  // Left in flight only when the next bucket is already waiting: its begin overlaps this one's
  // last collectives, and nothing waits for a bucket that has not come.
  if (queued && !b.is_last) {
    in_flight_ = InFlight{b, std::move(done), timing};
    return;
  }
  completions.push_back(finish_bucket(b, std::move(done), timing));
  if (b.is_last && !completions.back().second) end_step();
}

std::pair<BucketEngine::Done, std::exception_ptr> BucketEngine::finish_bucket(
    const BucketRequest& b, Done done, BucketTiming timing) {
  const Mark from = charge(cursor_, ReductionStats{}, false);
  ReductionStats delta;
  std::exception_ptr error;
  try {
    delta.nonfinite_buckets = allreduce_->finish_allreduce() ? 0 : 1;
    delta.buckets = 1;
    delta.compressed_buckets = 1;
    delta.uncompressed_bytes = ring_allreduce_bytes(b.numel, b.dtype, comm_->world_size());
    reduced_this_step_.push_back(b.identity);
    step_ids_.insert(b.identity);
  } catch (const std::exception& e) {
    error = failure(b, e);
  }
  cursor_ = charge(from, delta);
  if (!error) record_timing(timing);
  return {std::move(done), error};
}

void BucketEngine::fail_bucket(const BucketRequest& b, const std::exception& e) {
  ReductionStats delta;
  delta.failed_buckets = 1;
  delta.failed_steps = step_failed_ ? 0 : 1;
  delta.rejected_payloads = dynamic_cast<const PayloadError*>(&e) != nullptr ? 1 : 0;
  add_stats(delta);
  step_failed_ = true;
  GRADCOMP_CHECK(false, "bucket " << b.index << " (identity 0x" << std::hex << b.identity
                                  << std::dec << ", " << b.numel << " elements) of step "
                                  << (allreduce_ ? allreduce_->step() : 0) << " on rank "
                                  << comm_->rank() << ": " << e.what());
}

void BucketEngine::begin_step() {
  // A queued (CUDA) step reports its non-finite buckets and any rejected payload here without
  // waiting: the report asked for at one step boundary is picked up at a later one, once the
  // stream has passed it.
  uint64_t nonfinite = 0;
  if (allreduce_ && queued_ && allreduce_->poll(&nonfinite)) {
    ReductionStats delta;
    delta.nonfinite_buckets = nonfinite;
    add_stats(delta);
  }
  if (step_failed_) {
    // The failed step is undone, so that redoing it computes what it would have computed.
    if (allreduce_)
      for (uint64_t id : reduced_this_step_) allreduce_->revert_bucket(id);
    step_failed_ = false;
  } else if (allreduce_) {
    allreduce_->advance_step();
  }
  reduced_this_step_.clear();
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    step_stats_.max_queued = max_queued_step_;
    max_queued_step_ = 0;
  }
  // The finished step's buckets that ended before its last one was handed in.
  std::chrono::steady_clock::time_point last_in{};
  for (const BucketTiming& t : timeline_) last_in = std::max(last_in, t.submitted);
  uint64_t in_backward = 0;
  for (const BucketTiming& t : timeline_) in_backward += t.finished < last_in ? 1 : 0;
  step_stats_.buckets_in_backward += in_backward;
  total_.buckets_in_backward += in_backward;
  last_step_ = step_stats_;
  step_stats_ = ReductionStats{};
  last_timeline_ = std::move(timeline_);
  timeline_.clear();
}

void BucketEngine::reduce_segments(const std::vector<Segment>& segments, DType dtype, int64_t numel,
                                   uint64_t identity) {
  const Mark from = mark();
  const int n = static_cast<int>(segments.size());
  bool finite = true;
  if (queued_) {
    allreduce_->enqueue_allreduce(segments.data(), n, dtype, identity);
  } else {
    finite = allreduce_->allreduce(segments.data(), n, dtype, identity);
  }
  reduced_this_step_.push_back(identity);
  ReductionStats delta;
  delta.buckets = 1;
  delta.compressed_buckets = 1;
  delta.uncompressed_bytes = ring_allreduce_bytes(numel, dtype, comm_->world_size());
  delta.nonfinite_buckets = finite ? 0 : 1;
  charge(from, delta);
}

BucketEngine::Mark BucketEngine::mark() const {
  const CommCounters c = counters(*comm_, groups_);
  Mark m;
  m.bytes = c.bytes;
  m.inter_node_bytes = c.inter_node_bytes;
  m.comm_seconds = c.seconds;
  m.blocked_seconds = allreduce_ ? allreduce_->blocked_seconds() : 0.0;
  m.at = std::chrono::steady_clock::now();
  return m;
}

BucketEngine::Mark BucketEngine::charge(const Mark& from, ReductionStats delta, bool codec_time) {
  const Mark now = mark();
  delta.bytes_sent += now.bytes - from.bytes;
  delta.inter_node_bytes += now.inter_node_bytes - from.inter_node_bytes;
  delta.comm_seconds += now.comm_seconds - from.comm_seconds;
  // What this thread did not spend in or waiting for collectives: with pieces or overlapped
  // buckets, collectives run beside the codec on another thread and the two overlap.
  const double total = std::chrono::duration<double>(now.at - from.at).count();
  if (codec_time)
    delta.codec_seconds += std::max(0.0, total - (now.blocked_seconds - from.blocked_seconds));
  add_stats(delta);
  return now;
}

void BucketEngine::add_stats(const ReductionStats& delta) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  step_stats_.add(delta);
  total_.add(delta);
}

void BucketEngine::end_step() {
  // A front end that rebuilds its buckets (DDP after its first iteration) would otherwise leave
  // the old buckets' buffers and stale residuals behind, and a checkpoint would carry them. A
  // failed step says nothing about the layout in use (and its failed bucket kept its residual).
  if (step_failed_) {
    step_ids_.clear();
    return;
  }
  if (allreduce_ && !last_step_ids_.empty() && step_ids_ != last_step_ids_) {
    for (uint64_t id : last_step_ids_) {
      if (step_ids_.count(id) == 0) {
        allreduce_->release_bucket(id);
        layouts_.erase(id);
      }
    }
  }
  last_step_ids_ = std::move(step_ids_);
  step_ids_.clear();
}

ReductionStats BucketEngine::last_step_stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  ReductionStats s = step_stats_.buckets > 0 ? step_stats_ : last_step_;
  s.residual_bytes = allreduce_ ? allreduce_->residual_memory() : 0;
  if (step_stats_.buckets > 0) {
    std::lock_guard<std::mutex> queue_lock(queue_mu_);
    s.max_queued = max_queued_step_;
  }
  return s;
}

std::vector<BucketTiming> BucketEngine::step_timeline() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return timeline_.empty() ? last_timeline_ : timeline_;
}

ReductionStats BucketEngine::total_stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  ReductionStats s = total_;
  s.residual_bytes = allreduce_ ? allreduce_->residual_memory() : 0;
  std::lock_guard<std::mutex> queue_lock(queue_mu_);
  s.max_queued = max_queued_total_;
  return s;
}

bool BucketEngine::started() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return started_;
}

EngineState BucketEngine::state() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  EngineState s;
  s.compression = allreduce_ ? allreduce_->state() : pending_.compression;
  s.started = started_;
  s.world_size = comm_ != nullptr ? comm_->world_size() : pending_.world_size;
  s.local_world_size = pending_.local_world_size;
  // The layouts a restart needs: those of buckets with residuals, including restored ones no
  // step has used yet.
  for (const auto* layouts : {&restored_, &layouts_}) {
    for (const auto& [id, layout] : *layouts) {
      if (s.compression.residuals.count(id) != 0) s.layouts[id] = layout;
    }
  }
  return s;
}

void BucketEngine::check_state(const EngineState& s) const {
  GRADCOMP_CHECK(s.compression.seed == options_.config.seed,
                 "checkpoint seed " << s.compression.seed << " differs from the configured seed "
                                    << options_.config.seed);
  const int world = comm_ != nullptr ? comm_->world_size() : options_.world_size;
  check_same_world(s.world_size, world);
  check_same_local_world(s.local_world_size, pending_.local_world_size);
  const int local = std::max(1, pending_.local_world_size);
  GRADCOMP_CHECK(s.world_size == 0 || s.world_size % local == 0,
                 "the gradcomp state was saved by a job of " << s.world_size << " ranks, which "
                                                             << local
                                                             << " ranks per node do not divide");
  const CompressionConfig& c = options_.config;
  const bool keeps_residuals = options_.compress && c.error_feedback;
  const int saved_world = s.world_size > 0 ? s.world_size : world;
  struct Kind {
    const char* name;
    const std::map<uint64_t, std::vector<uint8_t>>* saved;
    bool kept;
    bool needs_world;
    uint64_t (*bytes)(const CompressionConfig&, int64_t, int);
  };
  const Kind kinds[] = {
      {"residual", &s.compression.residuals, keeps_residuals, false,
       [](const CompressionConfig& cc, int64_t n, int) { return residual_bytes(cc, n); }},
      {"chunk residual", &s.compression.chunk_residuals,
       keeps_residuals && chunk_residual_bytes(c, 1, 1) > 0, true, &chunk_residual_bytes},
      {"velocity", &s.compression.velocities, options_.compress && velocity_bytes(c, 1) > 0, false,
       [](const CompressionConfig& cc, int64_t n, int) { return velocity_bytes(cc, n); }},
  };
  for (const Kind& kind : kinds) {
    for (const auto& [id, bytes] : *kind.saved) {
      GRADCOMP_CHECK(kind.kept, "the gradcomp state holds a " << kind.name << " (bucket 0x"
                                                              << std::hex << id << std::dec
                                                              << "), which this configuration "
                                                                 "does not keep");
      // The bucket's size: from the saved layout, or from this engine's own bucket of that
      // identity; without either (or a world size, for chunks) it is checked at first use.
      int64_t numel = allreduce_ ? allreduce_->bucket_numel(id) : -1;
      auto layout = s.layouts.find(id);
      if (layout != s.layouts.end()) {
        numel = 0;
        for (const auto& param : layout->second.params) numel += param.second;
      }
      if (numel < 0 || (kind.needs_world && saved_world < local)) continue;
      // Hierarchical: a rank keeps the state of its shard, exchanged among the nodes.
      const uint64_t expect = kind.bytes(c, node_shard_numel(numel, local), saved_world / local);
      GRADCOMP_CHECK(bytes.size() == expect, "the gradcomp state's "
                                                 << kind.name << " of bucket 0x" << std::hex << id
                                                 << std::dec << " has " << bytes.size()
                                                 << " bytes; its layout (" << numel
                                                 << " elements) needs " << expect);
    }
  }
  // A configuration with momentum correction keeps a velocity beside each residual.
  if (options_.compress && velocity_bytes(c, 1) > 0) {
    for (const auto& [id, bytes] : s.compression.residuals)
      GRADCOMP_CHECK(s.compression.velocities.count(id) != 0,
                     "the gradcomp state has no velocity for bucket 0x"
                         << std::hex << id << std::dec
                         << " (saved without top-k momentum correction?), which this "
                            "configuration needs");
  }
}

void BucketEngine::load_state(EngineState s) {
  std::lock_guard<std::mutex> lock(state_mu_);
  check_state(s);
  GRADCOMP_CHECK(!restoring_ && held_.empty() && !in_flight_,
                 "load_state while the engine holds a step's buckets (call it between steps)");
  restored_.clear();
  for (auto& [id, layout] : s.layouts) {
    if (!layout.params.empty() && s.compression.residuals.count(id) != 0)
      restored_.emplace(id, std::move(layout));
  }
  started_ = s.started;
  step_failed_ = false;
  reduced_this_step_.clear();
  if (s.world_size != 0) pending_.world_size = s.world_size;
  if (s.local_world_size != 0) pending_.local_world_size = s.local_world_size;
  if (allreduce_) {
    allreduce_->load_state(s.compression);
  } else {
    pending_.compression = std::move(s.compression);
  }
}

}  // namespace gradcomp
