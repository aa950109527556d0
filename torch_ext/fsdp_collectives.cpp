// FSDP2's collectives: tensors checked, the core's reduce-scatter, allreduce and weight all-gather
// bound and counted.
#include "fsdp_collectives.h"

#include <chrono>

#include "profiled_backend.h"
#include "profiler_ranges.h"
#include "tensor_params.h"

#if defined(GRADCOMP_HAVE_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

namespace gradcomp {
namespace torch_ext {

FsdpCollective::FsdpCollective(c10::intrusive_ptr<c10d::ProcessGroup> group,
                               CompressionConfig config, std::chrono::milliseconds timeout)
    : group_(std::move(group)), config_(std::move(config)), timeout_(timeout) {
  GRADCOMP_TORCH_CHECK(group_, "FSDP collective without a process group");
  call_core([&] { config_.validate(); });
}

void FsdpCollective::bind(const at::Tensor& t) {
  const at::Device device = t.device();
  const void* stream = nullptr;
#if defined(GRADCOMP_HAVE_CUDA)
  if (device.is_cuda()) stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
#endif
  if (device_) {
    GRADCOMP_TORCH_CHECK(*device_ == device, "FSDP gradients on ", device,
                         " but this process group's gradcomp collective works on ", *device_,
                         " (its first call's device)");
    GRADCOMP_TORCH_CHECK(stream == stream_,
                         "FSDP collective called on another CUDA stream than its first call's");
    return;
  }
  comm_ = std::make_unique<ProcessGroupCommunicator>(group_, device, timeout_);
  if (device.is_cpu()) backend_ = std::make_unique<ProfiledBackend>(make_cpu_backend(1));
#if defined(GRADCOMP_HAVE_CUDA)
  if (device.is_cuda()) {
    cuda::CudaBackendOptions o;
    o.device = device.index();
    o.stream = static_cast<cudaStream_t>(const_cast<void*>(stream));
    o.kernels = config_.kernels;
    backend_ =
        std::make_unique<ProfiledBackend>(call_core([&] { return cuda::make_cuda_backend(o); }));
  }
#endif
  make_collective(*comm_, *backend_);
  if (pending_) {
    load_collective_state(*pending_);
    pending_.reset();
  }
  device_ = device;
  stream_ = stream;
}

uint64_t FsdpCollective::counted(const at::Tensor& t, uint64_t uncompressed,
                                 const std::function<uint64_t()>& run,
                                 const std::function<uint32_t()>& step) {
  std::lock_guard<std::mutex> lock(mu_);
  bind(t);
  const uint64_t bytes_before = comm_->bytes_sent();
  const double comm_before = comm_->seconds();
  const auto start = std::chrono::steady_clock::now();
  ReductionStats d;
  uint64_t nonfinite = 0;
  try {
    nonfinite = run();
  } catch (const Error& e) {
    count_failure(e);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const uint32_t this_step = step();
  const uint64_t residuals = residual_memory();
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  if (this_step != stats_step_ || total_.steps == 0) {
    step_ = ReductionStats{};
    d.steps = 1;
  }
  stats_step_ = this_step;
  d.buckets = d.compressed_buckets = 1;
  d.bytes_sent = comm_->bytes_sent() - bytes_before;
  d.inter_node_bytes = d.bytes_sent;
  d.uncompressed_bytes = world_size() > 1 ? uncompressed : 0;
  d.comm_seconds = comm_->seconds() - comm_before;
  d.codec_seconds = seconds - d.comm_seconds;
  d.nonfinite_buckets = nonfinite;
  d.observe_latency(seconds);
  total_.add(d);
  step_.add(d);
  total_.residual_bytes = step_.residual_bytes = residuals;  // a gauge: the latest value
  return nonfinite;
}

void FsdpCollective::count_failure(const Error& e) {
  {
    std::lock_guard<std::mutex> stats_lock(stats_mu_);
    ReductionStats d;
    d.failed_buckets = 1;
    d.failed_steps = step_.failed_buckets == 0 ? 1 : 0;  // one per step, not per module
    d.rejected_payloads = dynamic_cast<const PayloadError*>(&e) != nullptr ? 1 : 0;
    total_.add(d);
    step_.add(d);
  }
  // The front end's name goes after the core's own "gradcomp: ", not before it.
  const std::string what = e.what();
  const std::string core = "gradcomp: ";
  if (failure_prefix_.empty() || what.rfind(core, 0) != 0)
    TORCH_CHECK(false, failure_prefix_, what);
  TORCH_CHECK(false, core, failure_prefix_, what.substr(core.size()));
}

void FsdpCollective::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!bound()) return;
  uint64_t nonfinite = 0;
  try {
    nonfinite = flush_collective();
  } catch (const Error& e) {
    count_failure(e);
  }
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  total_.nonfinite_buckets += nonfinite;  // the last calls' steps: counted with the latest step
  step_.nonfinite_buckets += nonfinite;
}

ReductionStats FsdpCollective::total_stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return total_;
}

ReductionStats FsdpCollective::step_stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return step_;
}

CompressionState FsdpCollective::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (device_) return collective_state();
  if (pending_) return *pending_;
  CompressionState s;
  s.seed = config_.seed;
  return s;
}

void FsdpCollective::load_state(const CompressionState& state) {
  std::lock_guard<std::mutex> lock(mu_);
  GRADCOMP_TORCH_CHECK(state.seed == config_.seed, "checkpoint seed ", state.seed,
                       " differs from the configured seed ", config_.seed);
  if (device_) {
    load_collective_state(state);
  } else {
    pending_ = state;
  }
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  step_ = ReductionStats{};
}

// ---- the reduce-scatter --------------------------------------------------------------------

FsdpReduceScatter::FsdpReduceScatter(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                     CompressionConfig config, std::chrono::milliseconds timeout)
    : FsdpCollective(std::move(group), std::move(config), timeout) {}

void FsdpReduceScatter::make_collective(Communicator& comm, Backend& backend) {
  collective_ =
      call_core([&] { return std::make_unique<CompressedReduceScatter>(comm, backend, config_); });
}

CompressionState FsdpReduceScatter::collective_state() const {
  return call_core([&] { return collective_->state(); });
}

void FsdpReduceScatter::load_collective_state(const CompressionState& state) {
  call_core([&] { collective_->load_state(state); });
}

uint64_t FsdpReduceScatter::flush_collective() {
  GRADCOMP_PHASE("gradcomp::fsdp_reduce_scatter_flush");
  const uint64_t before = collective_->nonfinite_buckets();
  collective_->flush();
  return collective_->nonfinite_buckets() - before;
}

bool FsdpReduceScatter::reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                       uint64_t bucket_id, double divisor) {
  check_gradient_tensor(input, "FSDP reduce-scatter input");
  check_gradient_tensor(output, "FSDP reduce-scatter output");
  const int world = world_size();
  GRADCOMP_TORCH_CHECK(input.scalar_type() == output.scalar_type(), "FSDP reduce-scatter input is ",
                       input.scalar_type(), " but its output is ", output.scalar_type());
  GRADCOMP_TORCH_CHECK(input.device() == output.device(), "FSDP reduce-scatter input on ",
                       input.device(), " but its output on ", output.device());
  GRADCOMP_TORCH_CHECK(input.numel() == output.numel() * world, "FSDP reduce-scatter input has ",
                       input.numel(), " elements, not ", world, " (world size) x ", output.numel(),
                       " (output)");
  ReduceScatterRequest r;
  r.input = input.data_ptr();
  r.output = output.data_ptr();
  r.shard_numel = output.numel();
  r.dtype = to_dtype(input.scalar_type(), "FSDP reduce-scatter input");
  r.bucket_id = bucket_id;
  r.divisor = static_cast<float>(divisor);
  bool finite = true;
  counted(
      input, reduce_scatter_bytes(r.shard_numel, r.dtype, world),
      [&] {
        GRADCOMP_PHASE("gradcomp::fsdp_reduce_scatter");
        // The v2 reduce-scatter's earlier calls' non-finite verdicts arrive with this one.
        const uint64_t before = collective_->nonfinite_buckets();
        finite = collective_->reduce_scatter(r);
        return collective_->nonfinite_buckets() - before;
      },
      [&] { return collective_->next_step() - 1; });
  return finite;
}

// ---- the all-reduce across replicas --------------------------------------------------------

FsdpReplicaAllreduce::FsdpReplicaAllreduce(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                           CompressionConfig config,
                                           std::chrono::milliseconds timeout)
    : FsdpCollective(std::move(group), std::move(config), timeout) {}

void FsdpReplicaAllreduce::make_collective(Communicator& comm, Backend& backend) {
  collective_ =
      call_core([&] { return std::make_unique<CompressedAllreduce>(comm, backend, config_); });
}

CompressionState FsdpReplicaAllreduce::collective_state() const {
  CompressionState s = call_core([&] { return collective_->state(); });
  s.step = rounds_.next();
  return s;
}

void FsdpReplicaAllreduce::load_collective_state(const CompressionState& state) {
  call_core([&] { collective_->load_state(state); });
  rounds_.restart(state.step);
}

bool FsdpReplicaAllreduce::allreduce(const at::Tensor& tensor, uint64_t bucket_id) {
  check_gradient_tensor(tensor, "HSDP all-reduce gradient");
  const DType dtype = to_dtype(tensor.scalar_type(), "HSDP all-reduce gradient");
  const uint64_t nonfinite = counted(
      tensor, ring_allreduce_bytes(tensor.numel(), dtype, world_size()),
      [&] {
        GRADCOMP_PHASE("gradcomp::hsdp_allreduce");
        collective_->set_step(rounds_.step_for(bucket_id));
        const Segment whole = whole_segment(tensor);
        const bool finite = collective_->allreduce(&whole, 1, dtype, bucket_id);
        rounds_.done(bucket_id);
        return uint64_t{finite ? 0u : 1u};
      },
      [&] { return collective_->step(); });
  return nonfinite == 0;
}

// ---- the weight all-gather (int8 or 4-bit rows) ----------------------------------------------

FsdpAllGather::FsdpAllGather(c10::intrusive_ptr<c10d::ProcessGroup> group, AllGatherOptions options,
                             std::chrono::milliseconds timeout,
                             const std::optional<std::string>& front_end)
    : FsdpCollective(std::move(group), CompressionConfig{}, timeout),
      options_(options),
      label_(front_end.value_or("FSDP all-gather")) {
  if (front_end) failure_prefix_ = *front_end + ": ";
  call_core([&] { options_.validate(); });
}

void FsdpAllGather::make_collective(Communicator& comm, Backend& backend) {
  collective_ =
      call_core([&] { return std::make_unique<CompressedAllGather>(comm, backend, options_); });
}

CompressionState FsdpAllGather::collective_state() const {
  CompressionState s;
  s.seed = config_.seed;
  s.step = rounds_.next();
  return s;
}

void FsdpAllGather::all_gather(const at::Tensor& output, const at::Tensor& input,
                               const std::vector<AllGatherRun>& runs, uint64_t bucket_id,
                               const std::string& name, bool backward) {
  const int world = world_size();
  for (const at::Tensor* t : {&input, &output}) {
    const std::string what = label_ + (t == &input ? " input" : " output");
    GRADCOMP_TORCH_CHECK(t->defined() && t->is_contiguous(), what, " of ", name,
                         " must be a defined contiguous tensor");
    GRADCOMP_TORCH_CHECK(t->scalar_type() == at::kByte || t->scalar_type() == at::kFloat ||
                             t->scalar_type() == at::kBFloat16 || t->scalar_type() == at::kHalf,
                         what, " of ", name, " is ", t->scalar_type(),
                         ": the weight all-gather takes float32, bfloat16 or float16 parameters "
                         "(as themselves, or as FSDP's uint8 bytes of several of them)");
  }
  GRADCOMP_TORCH_CHECK(input.scalar_type() == output.scalar_type(), label_, " input of ", name,
                       " is ", input.scalar_type(), " but its output is ", output.scalar_type());
  GRADCOMP_TORCH_CHECK(input.device() == output.device(), label_, " input of ", name, " on ",
                       input.device(), " but its output on ", output.device());
  GRADCOMP_TORCH_CHECK(output.numel() == input.numel() * world, label_, " output of ", name,
                       " has ", output.numel(), " elements, not ", world, " (world size) x ",
                       input.numel(), " (input)");
  GRADCOMP_TORCH_CHECK(!runs.empty(), label_, " of ", name, " without a row layout");
  const uint64_t row_bytes = all_gather_row_bytes(runs.data(), static_cast<int>(runs.size()));
  GRADCOMP_TORCH_CHECK(row_bytes == static_cast<uint64_t>(input.nbytes()), label_, " of ", name,
                       ": its row layout covers ", row_bytes, " bytes but the input has ",
                       input.nbytes());
  AllGatherRequest r;
  r.input = input.data_ptr();
  r.output = output.data_ptr();
  r.runs = runs.data();
  r.num_runs = static_cast<int>(runs.size());
  r.bucket_id = bucket_id;
  r.name = name;
  // Forward and backward all-gathers of a module are two keys of one round: one training step.
  const uint64_t key = bucket_id * 2 + (backward ? 1 : 0);
  counted(
      input, static_cast<uint64_t>(world - 1) * row_bytes,
      [&] {
        GRADCOMP_PHASE("gradcomp::fsdp_all_gather");
        rounds_.step_for(key);
        collective_->all_gather(r);
        rounds_.done(key);
        return uint64_t{0};
      },
      [&] { return rounds_.next() - 1; });
}

}  // namespace torch_ext
}  // namespace gradcomp
