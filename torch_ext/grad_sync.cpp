// GradSync: buckets of parameter gradients handed to the core's BucketEngine from autograd's
// accumulate-grad hooks, and the averaged gradients written back at finish().
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <utility>

#include "gradcomp/torch.h"
#include "parameter_agreement.h"
#include "process_group_communicator.h"
#include "profiled_backend.h"
#include "tensor_params.h"
#include "torch_compat.h"

#if defined(GRADCOMP_HAVE_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gradcomp {
namespace {

using Clock = std::chrono::steady_clock;

std::string describe(const std::string& name, int64_t position, const at::Tensor& p) {
  std::ostringstream os;
  os << "parameter " << position;
  if (!name.empty()) os << " '" << name << "'";
  os << " (shape " << p.sizes() << ")";
  return os.str();
}

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Runs after a parameter's gradient is accumulated. Compiled autograd cannot trace it, and
// torch 2.7 dropped such a hook silently (its LambdaPostHook), so a step under compiled autograd
// would lose its gradients: this hook refuses it by name instead.
class GradientArrivedHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientArrivedHook(std::function<void()> arrived) : arrived_(std::move(arrived)) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    arrived_();
    return outputs;
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const override {
    GRADCOMP_CHECK(false,
                   "GradSync does not run under compiled autograd: its hooks run C++ code on "
                   "each gradient as it is accumulated, which compiled autograd cannot trace. "
                   "Run backward without compiled autograd (torch.compile of the model's forward "
                   "is fine), or use DDP with gradcomp.torch.register");
  }

 private:
  std::function<void()> arrived_;
};

}  // namespace

struct GradSync::Impl {
  struct Bucket {
    int64_t index = 0;
    DType dtype = DType::kFloat32;
    std::vector<int64_t> params;  // positions into params_, in bucket order
    std::vector<ParamSlice> slices;
    int64_t numel = 0;
    uint64_t identity = 0;
    at::Tensor buffer;
  };

  Impl(std::vector<at::Tensor> parameters, std::vector<std::string> names,
       c10::intrusive_ptr<c10d::ProcessGroup> group, const CodecSpec& codec,
       GradSyncOptions options);
  ~Impl();

  void assign_buckets();
  void install_hooks();
  void on_gradient(int64_t position);
  void launch(int64_t bucket);
  void launch_ready_buckets();
  void wait_for_launched(std::unique_lock<std::mutex>& lock);
  void finish();
  void write_back(const std::vector<char>& write);
  std::vector<char> used_anywhere(const std::vector<char>& used_here);
  void end_step(Clock::time_point finish_called);
  void reset_step();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  GradSyncOptions options_;
  std::string codec_name_;
  at::Device device_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_;  // by parameter
  std::vector<int64_t> slot_of_;    // by parameter: its slice in the bucket
  std::vector<torch_ext::compat::NodePtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  std::atomic<int> no_sync_depth_{0};
  mutable std::mutex mu_;  // the step state below
  std::condition_variable done_cv_;
  bool in_step_ = false;
  Clock::time_point first_gradient_;
  std::vector<char> ready_;       // by parameter
  std::vector<int64_t> pending_;  // by bucket: gradients still to come
  int64_t next_launch_ = 0;       // buckets launch in index order, the same on every rank
  int64_t completed_ = 0;         // buckets whose reduction ended
  std::exception_ptr failure_;    // the first failed bucket's error
  int64_t failed_bucket_ = -1;
  std::string misuse_;  // a gradient that arrived twice
  uint64_t steps_ = 0;
  GradSyncStats last_;

#if defined(GRADCOMP_HAVE_CUDA)
  std::optional<c10::Stream> cuda_stream_;
#endif
  std::unique_ptr<torch_ext::ProcessGroupCommunicator> comm_;
  NodeProcessGroups nodes_;
  torch_ext::NodeCommunicators node_comms_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<BucketEngine> engine_;  // last: destroyed first
};

namespace {

// The node's ranks exchange through shared memory: local rank 0 draws the segment's name and
// hands it to the others through the node group's store (a key per GradSync made, in the same
// order on every rank).
std::string node_shared_memory_name(const c10::intrusive_ptr<c10d::ProcessGroup>& node,
                                    int node_index) {
  static std::atomic<uint64_t> made{0};
  auto store = torch_ext::compat::store_of(node);
  GRADCOMP_CHECK(store,
                 "GradSync: the intra-node process group has no store this torch shows "
                 "(make node groups with gradcomp::split_node_groups)");
  // The node in the key too: groups a program made may share one store across nodes.
  const std::string key =
      "gradcomp/shm/" + std::to_string(node_index) + "/" + std::to_string(made++);
  std::string name;
  if (node->getRank() == 0) {
    std::random_device random;
    name = "/gradcomp-" + std::to_string(getpid()) + "-" + std::to_string(random()) + "-" +
           std::to_string(random());
    store->set(key, std::vector<uint8_t>(name.begin(), name.end()));
  } else {
    const std::vector<uint8_t> got = store->get(key);
    name.assign(got.begin(), got.end());
  }
  return name;
}

}  // namespace

GradSync::Impl::Impl(std::vector<at::Tensor> parameters, std::vector<std::string> names,
                     c10::intrusive_ptr<c10d::ProcessGroup> group, const CodecSpec& codec,
                     GradSyncOptions options)
    : group_(std::move(group)),
      options_(options),
      codec_name_(codec_spec_name(codec)),
      device_(at::kCPU) {
  GRADCOMP_CHECK(group_, "GradSync: no process group");
  check_per_step_codec(codec, "GradSync");
  GRADCOMP_CHECK(options_.bucket_cap_bytes > 0 && options_.first_bucket_cap_bytes > 0,
                 "GradSync: bucket caps must be positive, got "
                     << options_.first_bucket_cap_bytes << " and " << options_.bucket_cap_bytes);
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (!parameters[i].requires_grad()) continue;
    params_.push_back(parameters[i]);
    names_.push_back(i < names.size() ? names[i] : std::string());
  }
  GRADCOMP_CHECK(!params_.empty(), "GradSync: none of the parameters requires a gradient");
  device_ = params_[0].device();
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    GRADCOMP_CHECK(p.device() == device_, "GradSync: " << describe(names_[i], i, p) << " is on "
                                                       << p.device() << ", parameter 0 on "
                                                       << device_
                                                       << "; one GradSync covers one device");
    GRADCOMP_CHECK(p.layout() == at::kStrided,
                   "GradSync: " << describe(names_[i], i, p) << " is not a dense tensor");
    torch_ext::to_dtype(p.scalar_type(), "GradSync parameter");
  }
  torch_ext::check_same_model_on_every_rank(params_, *group_, device_, "GradSync");
  if (options_.broadcast_parameters) torch_ext::broadcast_parameters(params_, *group_);
  assign_buckets();

  EngineOptions engine_opts = engine_options(codec);
  comm_ = std::make_unique<torch_ext::ProcessGroupCommunicator>(group_, device_,
                                                                options_.collective_timeout);
  if (engine_opts.compress && device_.is_cpu())
    backend_ = std::make_unique<torch_ext::ProfiledBackend>(make_cpu_backend(1));
#if defined(GRADCOMP_HAVE_CUDA)
  if (device_.is_cuda()) {
    cuda_stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index()).unwrap();
    if (engine_opts.compress) {
      cuda::CudaBackendOptions o;
      o.device = device_.index();
      o.stream = c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, *cuda_stream_).stream();
      o.kernels = engine_opts.config.kernels;
      backend_ = std::make_unique<torch_ext::ProfiledBackend>(cuda::make_cuda_backend(o));
    }
  }
#else
  GRADCOMP_CHECK(device_.is_cpu(), "GradSync: parameters are on "
                                       << device_
                                       << " but this gradcomp build has no CUDA kernels");
#endif
  engine_opts.wrap_task = [](std::function<void()> task) -> std::function<void()> {
    return [task = std::move(task)] {
      RECORD_FUNCTION("gradcomp::grad_sync_bucket", std::vector<c10::IValue>());
      task();
    };
  };
  engine_opts.carry_context = &torch_ext::with_profiler_context;
  nodes_ = options_.node_groups;
  if (!nodes_.intra_node && options_.local_world_size != 1) {
    const auto timeout = options_.collective_timeout.count() > 0
                             ? options_.collective_timeout
                             : std::chrono::milliseconds(std::chrono::seconds(60));
    nodes_ = split_node_groups(group_, options_.local_world_size,
                               device_.is_cuda() ? "nccl" : "gloo", timeout);
  }
  NodeGroups groups;
  // Without compression every bucket takes the plain allreduce: no node groups are used.
  if (nodes_.intra_node && engine_opts.compress) {
    GRADCOMP_CHECK(nodes_.inter_node, "GradSync: node_groups needs the inter-node group too");
    const std::string shm_name =
        device_.is_cpu() && options_.node_shared_memory
            ? node_shared_memory_name(nodes_.intra_node, nodes_.inter_node->getRank())
            : std::string();
    node_comms_ = torch_ext::node_communicators(nodes_.intra_node, nodes_.inter_node, device_,
                                                options_.collective_timeout, shm_name);
    groups = node_comms_.groups();
    engine_opts.local_world_size = nodes_.intra_node->getSize();
  }
  engine_opts.worker_cpus = options_.worker_cpus;
  engine_ = std::make_unique<BucketEngine>(std::move(engine_opts));
  engine_->bind(*comm_, backend_.get(), groups);
  ready_.assign(params_.size(), 0);
  reset_step();
  install_hooks();
}

GradSync::Impl::~Impl() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  // Buckets still in flight end before the buffers, transport and backend go.
  engine_.reset();
}

void GradSync::Impl::assign_buckets() {
  // Reverse registration order, one open bucket per dtype; a bucket closes once it reaches its
  // cap, and the first bucket made has the small cap.
  std::map<DType, int64_t> open;  // dtype -> bucket position
  std::vector<int64_t> bytes;
  bucket_of_.assign(params_.size(), -1);
  slot_of_.assign(params_.size(), -1);
  for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
    const DType dtype = torch_ext::to_dtype(params_[i].scalar_type(), "GradSync parameter");
    auto it = open.find(dtype);
    if (it == open.end()) {
      Bucket b;
      b.index = static_cast<int64_t>(buckets_.size());
      b.dtype = dtype;
      buckets_.push_back(std::move(b));
      bytes.push_back(0);
      it = open.emplace(dtype, buckets_.size() - 1).first;
    }
    Bucket& b = buckets_[it->second];
    bucket_of_[i] = it->second;
    slot_of_[i] = static_cast<int64_t>(b.params.size());
    b.params.push_back(i);
    b.slices.push_back(ParamSlice{i, b.numel, params_[i].numel()});
    b.numel += params_[i].numel();
    bytes[it->second] += params_[i].numel() * static_cast<int64_t>(dtype_size(dtype));
    const int64_t cap = b.index == 0 ? options_.first_bucket_cap_bytes : options_.bucket_cap_bytes;
    if (bytes[it->second] >= cap) open.erase(it);
  }
  for (Bucket& b : buckets_) {
    std::vector<std::vector<int64_t>> shapes;
    for (int64_t p : b.params) shapes.push_back(params_[p].sizes().vec());
    b.identity = bucket_identity(b.index, b.numel, b.dtype, shapes);
    b.buffer = at::zeros({b.numel}, params_[b.params[0]].options().requires_grad(false));
  }
}

void GradSync::Impl::install_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    // The tensor holds its accumulator weakly; keeping it here keeps the hook alive.
    torch_ext::compat::NodePtr acc = torch::autograd::impl::grad_accumulator(params_[i]);
    GRADCOMP_CHECK(acc, "GradSync: " << describe(names_[i], i, params_[i])
                                     << " is not a leaf tensor with a gradient accumulator");
    const int64_t position = static_cast<int64_t>(i);
    hook_keys_.push_back(acc->add_post_hook(
        std::make_unique<GradientArrivedHook>([this, position] { on_gradient(position); })));
    accumulators_.push_back(std::move(acc));
  }
}

void GradSync::Impl::reset_step() {
  in_step_ = false;
  std::fill(ready_.begin(), ready_.end(), 0);
  pending_.resize(buckets_.size());
  for (const Bucket& b : buckets_) pending_[b.index] = static_cast<int64_t>(b.params.size());
  next_launch_ = 0;
  completed_ = 0;
  failure_ = nullptr;
  failed_bucket_ = -1;
  misuse_.clear();
}

void GradSync::Impl::on_gradient(int64_t position) {
  if (no_sync_depth_.load() > 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!in_step_) {
      in_step_ = true;
      first_gradient_ = Clock::now();
    }
    if (ready_[position]) {
      if (misuse_.empty())
        misuse_ = describe(names_[position], position, params_[position]) +
                  " received a gradient twice before finish() (a second backward without "
                  "finish(), or no_sync() left between them?)";
      return;
    }
    ready_[position] = 1;
    const Bucket& b = buckets_[bucket_of_[position]];
    const ParamSlice& s = b.slices[slot_of_[position]];
    const at::Tensor& grad = params_[position].grad();
    at::Tensor slot = b.buffer.narrow(0, s.offset, s.numel);
    if (grad.defined()) {
      slot.copy_(grad.reshape({-1}));
    } else {
      slot.zero_();
    }
    --pending_[b.index];
  }
  launch_ready_buckets();
}

void GradSync::Impl::launch_ready_buckets() {
  // Only autograd's thread for the device (or finish(), after backward) gets here, so buckets
  // leave in index order.
  for (;;) {
    int64_t b = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_launch_ < static_cast<int64_t>(buckets_.size()) && pending_[next_launch_] == 0)
        b = next_launch_++;
    }
    if (b < 0) return;
    launch(b);
  }
}

void GradSync::Impl::launch(int64_t index) {
  Bucket& b = buckets_[index];
  BucketRequest r;
  r.data = b.buffer.data_ptr();
  r.numel = b.numel;
  r.dtype = b.dtype;
  r.index = b.index;
  r.identity = b.identity;
  r.is_last = index + 1 == static_cast<int64_t>(buckets_.size());
  r.params = b.slices;
  auto done = [this, index](std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error && !failure_) {
      failure_ = std::move(error);
      failed_bucket_ = index;
    }
    // Dropped under mu_ too, so the exception's last release is ordered after the step's reads of
    // it by the lock (see CollectiveQueue::run).
    error = nullptr;
    ++completed_;
    done_cv_.notify_all();
  };
#if defined(GRADCOMP_HAVE_CUDA)
  if (device_.is_cuda()) {
    c10::cuda::CUDAStream filled = c10::cuda::getCurrentCUDAStream(device_.index());
    c10::cuda::CUDAStream compress(c10::cuda::CUDAStream::UNCHECKED, *cuda_stream_);
    torch_ext::compat::CudaEvent ready;
    ready.record(filled);
    ready.block(compress);
    c10::cuda::CUDAStreamGuard guard(compress);
    engine_->reduce(r, done);
    return;
  }
#endif
  engine_->submit(std::move(r), done);
}

void GradSync::Impl::wait_for_launched(std::unique_lock<std::mutex>& lock) {
  done_cv_.wait(lock, [&] { return completed_ == next_launch_; });
}

std::vector<char> GradSync::Impl::used_anywhere(const std::vector<char>& used_here) {
  // One small plain allreduce, after the buckets' collectives, so it cannot interleave them.
  at::Tensor used = at::empty({static_cast<int64_t>(params_.size())}, at::kFloat);
  for (size_t i = 0; i < params_.size(); ++i) used[i] = used_here[i] ? 1.0f : 0.0f;
  at::Tensor on_device = used.to(device_);
  comm_->allreduce_mean(on_device.data_ptr(), on_device.numel(), DType::kFloat32);
  const at::Tensor mean = on_device.cpu();
  std::vector<char> out(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) out[i] = mean[i].item<float>() > 0.0f;
  return out;
}

void GradSync::Impl::write_back(const std::vector<char>& write) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!write[i]) continue;
    const Bucket& b = buckets_[bucket_of_[i]];
    const ParamSlice& s = b.slices[slot_of_[i]];
    at::Tensor averaged = b.buffer.narrow(0, s.offset, s.numel).view(params_[i].sizes());
    at::Tensor& grad = params_[i].mutable_grad();
    if (grad.defined()) {
      grad.copy_(averaged);
    } else {
      grad = averaged.clone();
    }
  }
}

void GradSync::Impl::finish() {
  if (no_sync_depth_.load() > 0) return;
  const Clock::time_point finish_called = Clock::now();
  std::vector<std::string> missing;
  std::vector<char> used_here;
  {
    std::unique_lock<std::mutex> lock(mu_);
    used_here = ready_;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!ready_[i]) missing.push_back(describe(names_[i], i, params_[i]));
    if (!misuse_.empty() || (!missing.empty() && !options_.find_unused_parameters)) {
      wait_for_launched(lock);
      const std::string misuse = misuse_;
      reset_step();
      GRADCOMP_CHECK(misuse.empty(), "GradSync: " << misuse);
      std::ostringstream os;
      for (size_t k = 0; k < missing.size() && k < 8; ++k) os << (k ? ", " : "") << missing[k];
      if (missing.size() > 8) os << " and " << missing.size() - 8 << " more";
      // A parameter whose tensor was replaced (torch::load into the module, set_data) has a new
      // accumulator, which the hooks were never put on.
      size_t replaced = 0;
      for (size_t i = 0; i < params_.size(); ++i)
        replaced += torch::autograd::impl::try_get_grad_accumulator(params_[i]) != accumulators_[i];
      GRADCOMP_CHECK(replaced == 0, "GradSync on rank "
                                        << group_->getRank() << ": " << replaced
                                        << " parameters got new gradient accumulators after the "
                                           "GradSync was made (load parameters, e.g. with "
                                           "torch::load, before making it); no gradient arrived "
                                           "for "
                                        << os.str());
      GRADCOMP_CHECK(false, "GradSync on rank "
                                << group_->getRank() << ": no gradient arrived this step for "
                                << os.str()
                                << "; construct GradSync with find_unused_parameters = true if "
                                   "the model does not use every parameter in every step (other "
                                   "ranks wait for this rank's buckets until the process "
                                   "group's timeout)");
    }
    if (!in_step_) first_gradient_ = finish_called;
    // Unused parameters count as zero here; their buckets can leave now.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (ready_[i]) continue;
      ready_[i] = 1;
      const Bucket& b = buckets_[bucket_of_[i]];
      const ParamSlice& s = b.slices[slot_of_[i]];
      b.buffer.narrow(0, s.offset, s.numel).zero_();
      --pending_[b.index];
    }
  }
  launch_ready_buckets();
  std::unique_lock<std::mutex> lock(mu_);
  wait_for_launched(lock);
  if (failure_) {
    const std::exception_ptr failure = failure_;
    const int64_t bucket = failed_bucket_;
    reset_step();
    lock.unlock();
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      GRADCOMP_CHECK(false, "GradSync on rank " << group_->getRank() << ", step " << steps_
                                                << ", bucket " << bucket << ": " << e.what());
    }
  }
  lock.unlock();
#if defined(GRADCOMP_HAVE_CUDA)
  if (device_.is_cuda()) {
    torch_ext::compat::CudaEvent reduced;
    reduced.record(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, *cuda_stream_));
    reduced.block(c10::cuda::getCurrentCUDAStream(device_.index()));
  }
#endif
  std::vector<char> write(params_.size(), 1);
  if (options_.find_unused_parameters) write = used_anywhere(used_here);
  write_back(write);
  lock.lock();
  end_step(finish_called);
  reset_step();
}

void GradSync::Impl::end_step(Clock::time_point finish_called) {
  GradSyncStats s;
  s.step = engine_->last_step_stats();
  s.total = engine_->total_stats();
  s.backward_seconds = seconds(finish_called - first_gradient_);
  for (const BucketTiming& t : engine_->step_timeline()) {
    s.reduction_seconds += seconds(t.finished - t.started);
    const Clock::time_point from = std::max(t.started, first_gradient_);
    const Clock::time_point to = std::min(t.finished, finish_called);
    if (to > from) s.overlapped_seconds += seconds(to - from);
  }
  s.finish_wait_seconds = seconds(Clock::now() - finish_called);
  last_ = s;
  ++steps_;
}

GradSync::GradSync(std::vector<at::Tensor> parameters, c10::intrusive_ptr<c10d::ProcessGroup> group,
                   CodecSpec codec, GradSyncOptions options)
    : impl_(std::make_unique<Impl>(std::move(parameters), std::vector<std::string>{},
                                   std::move(group), codec, options)) {}

GradSync::GradSync(const torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group,
                   CodecSpec codec, GradSyncOptions options) {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters()) {
    names.push_back(item.key());
    params.push_back(item.value());
  }
  impl_ =
      std::make_unique<Impl>(std::move(params), std::move(names), std::move(group), codec, options);
}

GradSync::~GradSync() = default;

void GradSync::finish() {
  impl_->finish();
}

GradSync::NoSync::NoSync(GradSync& sync) : sync_(sync) {
  ++sync_.impl_->no_sync_depth_;
}

GradSync::NoSync::~NoSync() {
  --sync_.impl_->no_sync_depth_;
}

GradSyncStats GradSync::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  GradSyncStats s = impl_->last_;
  s.total = impl_->engine_->total_stats();
  return s;
}

std::string GradSync::metrics_text() const {
  return prometheus_text(stats().total, metric_labels(rank(), impl_->codec_name_, "gradsync"));
}

void GradSync::write_metrics(const std::string& path) const {
  write_file_atomically(path, metrics_text());
}

std::vector<std::vector<int64_t>> GradSync::buckets() const {
  std::vector<std::vector<int64_t>> out;
  for (const Impl::Bucket& b : impl_->buckets_) out.push_back(b.params);
  return out;
}

int GradSync::rank() const {
  return impl_->group_->getRank();
}

int GradSync::world_size() const {
  return impl_->group_->getSize();
}

std::vector<int> GradSync::worker_cpus() const {
  return impl_->engine_->worker_cpus();
}

std::string GradSync::worker_placement() const {
  return impl_->engine_->worker_placement();
}

EngineState GradSync::state() const {
  return impl_->engine_->state();
}

void GradSync::load_state(EngineState state) {
  impl_->engine_->load_state(std::move(state));
}

void GradSync::save(torch::serialize::OutputArchive& archive) const {
  const std::vector<uint8_t> bytes = serialize_engine_state(state());
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  archive.write("gradcomp_engine_state", t);
}

void GradSync::load(torch::serialize::InputArchive& archive) {
  at::Tensor t;
  archive.read("gradcomp_engine_state", t);
  GRADCOMP_CHECK(t.scalar_type() == at::kByte && t.dim() == 1,
                 "GradSync checkpoint: gradcomp_engine_state is not a 1-D uint8 tensor");
  t = t.contiguous().cpu();
  load_state(parse_engine_state(t.data_ptr<uint8_t>(), static_cast<size_t>(t.numel())));
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradSync& sync) {
  sync.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradSync& sync) {
  sync.load(archive);
  return archive;
}

}  // namespace gradcomp
