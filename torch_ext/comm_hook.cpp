// DDP communication hook over a c10d ProcessGroup: CPU buckets on a worker thread, CUDA buckets
// on the current stream; the core's CompressedAllreduce does the work.
#include "comm_hook.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>

#include "tensor_params.h"

#if defined(GRADCOMP_HAVE_CUDA)
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nvtx3/nvToolsExt.h>
#endif

namespace gradcomp {
namespace torch_ext {
namespace {

// An NVTX range for the CUDA timeline (nothing in CPU-only builds); the PyTorch profiler sees
// the same phases through RECORD_FUNCTION.
struct NvtxRange {
  explicit NvtxRange(const char* name) {
#if defined(GRADCOMP_HAVE_CUDA)
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~NvtxRange() {
#if defined(GRADCOMP_HAVE_CUDA)
    nvtxRangePop();
#endif
  }
};

#define GRADCOMP_PHASE(name)                         \
  RECORD_FUNCTION(name, std::vector<c10::IValue>()); \
  NvtxRange gradcomp_nvtx_range_(name)

}  // namespace

// The core's collective interface over a c10d ProcessGroup (Gloo or NCCL).
class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, at::Device device)
      : group_(std::move(group)), device_(device) {}
  int rank() const override { return group_->getRank(); }
  int world_size() const override { return group_->getSize(); }
  bool device_memory() const override { return device_.is_cuda(); }

  void all_to_all(const void* send, void* recv, size_t bytes) override {
    GRADCOMP_PHASE("gradcomp::all_to_all");
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor in = wrap(const_cast<void*>(send), bytes * world_size());
    at::Tensor out = wrap(recv, bytes * world_size());
    std::vector<int64_t> splits;
    group_->all_to_all_single(out, in, splits, splits)->wait();
    bytes_sent_ += bytes * static_cast<uint64_t>(world_size() - 1);
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    GRADCOMP_PHASE("gradcomp::all_gather");
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor in = wrap(const_cast<void*>(send), bytes);
    at::Tensor out = wrap(recv, bytes * world_size());
    group_->all_gather_single(out, in)->wait();
    bytes_sent_ += bytes * static_cast<uint64_t>(world_size() - 1);
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // Plain allreduce of the bucket (the NoCompression path), counted like the ring it runs.
  void allreduce_sum(at::Tensor& bucket) {
    GRADCOMP_PHASE("gradcomp::allreduce");
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<at::Tensor> tensors = {bucket};
    group_->allreduce(tensors)->wait();
    const int w = world_size();
    bytes_sent_ +=
        static_cast<uint64_t>(2.0 * (w - 1) / w * bucket.numel() * bucket.element_size());
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  double seconds() const { return seconds_; }

 private:
  at::Tensor wrap(void* p, size_t bytes) {
    return at::from_blob(p, {static_cast<int64_t>(bytes)},
                         at::TensorOptions().dtype(at::kByte).device(device_));
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Device device_;
  double seconds_ = 0;
};

uint64_t bucket_identity(int64_t index, int64_t numel, at::ScalarType dtype,
                         const std::vector<std::vector<int64_t>>& param_shapes) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xFF;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(index));
  mix(static_cast<uint64_t>(numel));
  mix(static_cast<uint64_t>(dtype));
  for (const auto& shape : param_shapes) {
    mix(shape.size());
    for (int64_t d : shape) mix(static_cast<uint64_t>(d));
  }
  return h;
}

HookCore::HookCore(c10::intrusive_ptr<c10d::ProcessGroup> group, HookOptions options)
    : group_(std::move(group)), options_(std::move(options)) {
  GRADCOMP_TORCH_CHECK(group_, "the DDP model has no process group");
  call_core([&] { options_.config.validate(); });
  cpu_backend_ = make_cpu_backend(1);
  worker_ = std::thread([this] { worker_loop(); });
}

HookCore::~HookCore() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  worker_.join();
}

int HookCore::world_size() const {
  return group_->getSize();
}

CompressedAllreduce& HookCore::engine_for(const at::Tensor& bucket) {
  const at::Device device = bucket.device();
  if (!comm_) {
    comm_ = std::make_unique<ProcessGroupCommunicator>(group_, device);
  }
  if (!engine_ && options_.compress) {
    // CUDA: the backend of the current stream, which is the hook's compression stream.
    Backend& backend = device.is_cuda() ? backend_for(bucket) : *cpu_backend_;
    engine_ = call_core(
        [&] { return std::make_unique<CompressedAllreduce>(*comm_, backend, options_.config); });
    if (pending_state_) {
      call_core([&] { engine_->load_state(*pending_state_); });
      pending_state_.reset();
    }
  }
  return *engine_;
}

void HookCore::set_parameters(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(params_mu_);
  param_index_.clear();
  for (size_t i = 0; i < params.size(); ++i)
    param_index_.emplace(params[i].unsafeGetTensorImpl(), static_cast<int64_t>(i));
}

int64_t HookCore::param_index(const at::Tensor& param) const {
  std::lock_guard<std::mutex> lock(params_mu_);
  auto it = param_index_.find(param.unsafeGetTensorImpl());
  return it == param_index_.end() ? -1 : it->second;
}

c10::intrusive_ptr<c10::ivalue::Future> HookCore::submit(at::Tensor bucket, int64_t index,
                                                         uint64_t identity, bool is_last,
                                                         std::vector<ParamSlice> params) {
  check_gradient_tensor(bucket, "DDP bucket");
  if (bucket.device().is_cuda()) {
#if defined(GRADCOMP_HAVE_CUDA)
    // Compression runs on one high-priority stream of this hook (the engine's backend is bound
    // to it), ordered after the stream that filled the bucket. Nothing here waits for the
    // device: the future is created with the device and completed while the compression stream
    // is current, so it records CUDA events there and the reducer's wait orders the backward
    // stream after them.
    const c10::Device device = bucket.device();
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(),
                                                           std::vector<c10::Device>{device});
    c10::cuda::CUDAStream filled = c10::cuda::getCurrentCUDAStream(device.index());
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      if (!cuda_stream_) {
        cuda_stream_ =
            c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index()).unwrap();
      }
      GRADCOMP_TORCH_CHECK(cuda_stream_->device() == device, "DDP bucket on ", device,
                           " but this hook compresses on ", cuda_stream_->device(),
                           "; register one hook per device");
    }
    c10::cuda::CUDAStream compress(c10::cuda::CUDAStream::UNCHECKED, *cuda_stream_);
    c10::cuda::CUDAStreamGuard guard(compress);
    c10::cuda::CUDAEvent ready;
    ready.record(filled);
    ready.block(compress);
    bucket.record_stream(compress);
    try {
      if (reduce(bucket, index, identity, is_last, params, future))
        future->markCompleted(c10::IValue(bucket));
    } catch (...) {
      future->setError(std::current_exception());
    }
    return future;
#endif
  }
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_.push_back(Job{bucket, index, identity, is_last, std::move(params), future,
                         at::get_record_function_tls_(), c10::ThreadLocalDebugInfo::current()});
  }
  queue_cv_.notify_one();
  return future;
}

void HookCore::worker_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    // Work done here shows in the profiler of the thread that queued it.
    at::set_record_function_tls_(job.record_function_tls);
    c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(job.debug_info);
    try {
      if (reduce(job.bucket, job.index, job.identity, job.is_last, job.params, job.future))
        job.future->markCompleted(c10::IValue(job.bucket));
    } catch (...) {
      job.future->setError(std::current_exception());
    }
    at::set_record_function_tls_(at::RecordFunctionTLS());
    c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(nullptr);
  }
}

bool HookCore::reduce(at::Tensor bucket, int64_t index, uint64_t identity, bool is_last,
                      const std::vector<ParamSlice>& params,
                      const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  GRADCOMP_PHASE("gradcomp::hook_bucket");
  check_gradient_tensor(bucket, "DDP bucket");
  std::unique_lock<std::mutex> lock(state_mu_);
  CompressedAllreduce* engine = options_.compress ? &engine_for(bucket) : nullptr;
  if (!comm_) comm_ = std::make_unique<ProcessGroupCommunicator>(group_, bucket.device());
  const bool queued = bucket.is_cuda();
  // Bucket 0 arriving again starts a new step (DDP launches buckets in index order). Queued
  // (CUDA) steps report their non-finite buckets and any rejected payload here without
  // waiting: the report asked for at one step boundary is picked up at a later one, once the
  // compression stream has passed it.
  if (index == 0 && started_) {
    uint64_t nonfinite = 0;
    if (engine != nullptr && queued && call_core([&] { return engine->poll(&nonfinite); })) {
      step_stats_.nonfinite_buckets += nonfinite;
      total_.nonfinite_buckets += nonfinite;
    }
    if (engine != nullptr) engine->advance_step();
    last_step_ = step_stats_;
    step_stats_ = HookStats{};
  }
  started_ = true;
  const DType dtype = to_dtype(bucket.scalar_type(), "DDP bucket");
  if (!params.empty()) {
    BucketLayout layout;
    layout.index = index;
    layout.dtype = static_cast<int>(dtype);
    for (const ParamSlice& p : params) layout.params.emplace_back(p.param, p.numel);
    layouts_[identity] = std::move(layout);
  }

  // The first step after load_state: DDP's first-iteration buckets can differ from the rebuilt
  // ones the checkpoint saved. Then this step's buckets are held back and, at the last one, the
  // saved buckets are reduced as segment lists over them, exactly as the run that saved them
  // would have; DDP waits for the futures only after its last bucket, so holding them is safe.
  if (!restored_.empty() && !restoring_ && held_.empty()) {
    restoring_ = engine != nullptr && !params.empty() && future && restored_.count(identity) == 0;
    if (!restoring_) restored_.clear();
  }
  if (restoring_) {
    held_.push_back(Held{bucket, identity, params, future});
    if (!is_last) return false;
    std::vector<Held> held = std::move(held_);
    held_.clear();
    restoring_ = false;
    // The held futures complete outside the lock (their callbacks may call back in); the
    // caller completes this bucket's own future.
    try {
      reduce_restored_layouts(engine, held, queued);
    } catch (...) {
      restored_.clear();
      lock.unlock();
      for (size_t i = 0; i + 1 < held.size(); ++i)
        held[i].future->setError(std::current_exception());
      throw;
    }
    restored_.clear();
    end_step(engine);
    lock.unlock();
    for (size_t i = 0; i + 1 < held.size(); ++i)
      held[i].future->markCompleted(c10::IValue(held[i].bucket));
    return true;
  }

  if (engine != nullptr) {
    reduce_segments(engine, {whole_segment(bucket)}, dtype, bucket.numel(), bucket.element_size(),
                    identity, queued);
  } else {
    // DDP without a hook multiplies each gradient by 1/W before a SUM allreduce; doing the same
    // keeps NoCompression bit-identical to it.
    const uint64_t sent0 = comm_->bytes_sent();
    const double comm0 = comm_->seconds();
    const int w = group_->getSize();
    bucket.mul_(1.0 / static_cast<double>(w));
    comm_->allreduce_sum(bucket);
    HookStats delta;
    delta.buckets = 1;
    delta.bytes_sent = comm_->bytes_sent() - sent0;
    delta.uncompressed_bytes =
        static_cast<uint64_t>(2.0 * (w - 1) / w * bucket.numel() * bucket.element_size());
    delta.comm_seconds = comm_->seconds() - comm0;
    add_stats(delta);
  }
  step_ids_.insert(identity);
  if (is_last) end_step(engine);
  return true;
}

void HookCore::reduce_segments(CompressedAllreduce* engine, const std::vector<Segment>& segments,
                               DType dtype, int64_t numel, size_t element_size, uint64_t identity,
                               bool queued) {
  const uint64_t sent0 = comm_->bytes_sent();
  const double comm0 = comm_->seconds();
  const auto t0 = std::chrono::steady_clock::now();
  const int n = static_cast<int>(segments.size());
  bool finite = true;
  if (queued) {
    call_core([&] { engine->enqueue_allreduce(segments.data(), n, dtype, identity); });
  } else {
    finite = call_core([&] { return engine->allreduce(segments.data(), n, dtype, identity); });
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int w = group_->getSize();
  HookStats delta;
  delta.buckets = 1;
  delta.bytes_sent = comm_->bytes_sent() - sent0;
  delta.uncompressed_bytes = static_cast<uint64_t>(2.0 * (w - 1) / w * numel * element_size);
  delta.comm_seconds = comm_->seconds() - comm0;
  delta.codec_seconds = total - delta.comm_seconds;
  delta.nonfinite_buckets = finite ? 0 : 1;
  add_stats(delta);
}

void HookCore::add_stats(const HookStats& delta) {
  for (HookStats* s : {&step_stats_, &total_}) {
    s->buckets += delta.buckets;
    s->bytes_sent += delta.bytes_sent;
    s->uncompressed_bytes += delta.uncompressed_bytes;
    s->comm_seconds += delta.comm_seconds;
    s->codec_seconds += delta.codec_seconds;
    s->nonfinite_buckets += delta.nonfinite_buckets;
  }
}

void HookCore::reduce_restored_layouts(CompressedAllreduce* engine, const std::vector<Held>& held,
                                       bool queued) {
  // Where each parameter's gradient is in this step's buckets, and in which dtype.
  struct Place {
    char* data;
    int64_t numel;
    DType dtype;
  };
  std::unordered_map<int64_t, Place> where;
  for (const Held& h : held) {
    char* base = static_cast<char*>(h.bucket.data_ptr());
    const DType dtype = to_dtype(h.bucket.scalar_type(), "DDP bucket");
    for (const ParamSlice& p : h.params)
      where[p.param] =
          Place{base + p.offset * static_cast<int64_t>(h.bucket.element_size()), p.numel, dtype};
  }
  std::vector<std::pair<int64_t, uint64_t>> order;  // saved bucket index, identity
  size_t saved_params = 0;
  bool complete = true;
  for (const auto& kv : restored_) {
    order.emplace_back(kv.second.index, kv.first);
    saved_params += kv.second.params.size();
    for (const auto& [param, numel] : kv.second.params) {
      auto it = where.find(param);
      complete &= it != where.end() && it->second.numel == numel &&
                  static_cast<int>(it->second.dtype) == kv.second.dtype;
    }
  }
  if (!complete || saved_params != where.size()) {
    // Another model than the checkpoint's: reduce DDP's buckets as they are.
    for (const Held& h : held) {
      reduce_segments(engine, {whole_segment(h.bucket)},
                      to_dtype(h.bucket.scalar_type(), "DDP bucket"), h.bucket.numel(),
                      h.bucket.element_size(), h.identity, queued);
      step_ids_.insert(h.identity);
    }
    return;
  }
  std::sort(order.begin(), order.end());
  for (const auto& entry : order) {
    const uint64_t identity = entry.second;
    const BucketLayout& layout = restored_.at(identity);
    const DType dtype = static_cast<DType>(layout.dtype);
    std::vector<Segment> segments;
    int64_t offset = 0;
    for (const auto& [param, numel] : layout.params) {
      segments.push_back(Segment{where.at(param).data, offset, numel});
      offset += numel;
    }
    reduce_segments(engine, segments, dtype, offset, dtype_size(dtype), identity, queued);
    step_ids_.insert(identity);
    layouts_[identity] = layout;
  }
  for (const Held& h : held) {
    if (restored_.count(h.identity) == 0) layouts_.erase(h.identity);
  }
}

void HookCore::end_step(CompressedAllreduce* engine) {
  // DDP rebuilds its buckets after the first iteration; the buckets of the old layout would
  // otherwise keep their buffers and stale residuals (and a checkpoint would carry them).
  if (engine != nullptr && !last_step_ids_.empty() && step_ids_ != last_step_ids_) {
    for (uint64_t id : last_step_ids_) {
      if (step_ids_.count(id) == 0) {
        call_core([&] { engine->release_bucket(id); });
        layouts_.erase(id);
      }
    }
  }
  last_step_ids_ = std::move(step_ids_);
  step_ids_.clear();
}

HookStats HookCore::last_step_stats() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return step_stats_.buckets > 0 ? step_stats_ : last_step_;
}

HookStats HookCore::total_stats() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return total_;
}

bool HookCore::started() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return started_;
}

CompressionState HookCore::state() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (engine_) return call_core([&] { return engine_->state(); });
  if (pending_state_) return *pending_state_;
  CompressionState s;
  s.seed = options_.config.seed;
  return s;
}

std::map<uint64_t, HookCore::BucketLayout> HookCore::layouts() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return layouts_;
}

void HookCore::load_state(const CompressionState& state, bool started,
                          std::map<uint64_t, BucketLayout> layouts) {
  std::lock_guard<std::mutex> lock(state_mu_);
  // Only layouts with saved residuals matter for an exact restart.
  restored_.clear();
  for (auto& kv : layouts) {
    if (!kv.second.params.empty() && state.residuals.count(kv.first) != 0)
      restored_.emplace(kv.first, std::move(kv.second));
  }
  GRADCOMP_TORCH_CHECK(state.seed == options_.config.seed, "state_dict seed ", state.seed,
                       " differs from this hook's seed ", options_.config.seed);
  started_ = started;
  if (engine_) {
    call_core([&] { engine_->load_state(state); });
  } else {
    pending_state_ = std::make_unique<CompressionState>(state);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> GradcompCommHook::runHook(c10d::GradBucket& bucket) {
  std::vector<std::vector<int64_t>> shapes;
  for (const at::Tensor& p : bucket.getParameters()) shapes.push_back(p.sizes().vec());
  at::Tensor& buffer = bucket.getBufferRef();
  const uint64_t id = bucket_identity(static_cast<int64_t>(bucket.getIndex()), buffer.numel(),
                                      buffer.scalar_type(), shapes);
  std::vector<HookCore::ParamSlice> slices;
  const std::vector<at::Tensor> params = bucket.getParameters();
  const std::vector<at::Tensor> grads = bucket.getGradients();
  const auto* base = static_cast<const char*>(buffer.data_ptr());
  for (size_t i = 0; i < params.size() && i < grads.size(); ++i) {
    const int64_t position = core_->param_index(params[i]);
    if (position < 0) {
      slices.clear();  // parameters unknown (set_parameters not called): no layout recorded
      break;
    }
    const int64_t offset =
        (static_cast<const char*>(grads[i].data_ptr()) - base) / buffer.element_size();
    slices.push_back({position, offset, grads[i].numel()});
  }
  return core_->submit(buffer, static_cast<int64_t>(bucket.getIndex()), id, bucket.isLast(),
                       std::move(slices));
}

at::Tensor GradcompCommHook::parseHookResult(const c10::IValue& result) {
  return result.isTensor() ? result.toTensor() : result.toTensorVector()[0];
}

}  // namespace torch_ext
}  // namespace gradcomp
