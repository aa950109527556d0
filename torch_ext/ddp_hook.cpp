// The DDP hook's adapter: DDP buckets to engine requests, futures, the CUDA compression stream.
#include "ddp_hook.h"

#include <utility>

#include "profiled_backend.h"
#include "profiler_ranges.h"
#include "tensor_params.h"
#include "torch_compat.h"

#if defined(GRADCOMP_HAVE_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gradcomp {
namespace torch_ext {

EngineOptions ddp_engine_options(const CodecSpec& codec) {
  EngineOptions o = call_core([&] {
    check_per_step_codec(codec, "the DDP communication hook");
    return engine_options(codec);
  });
  o.wrap_task = [](std::function<void()> task) {
    return with_profiler_context([task = std::move(task)] {
      GRADCOMP_PHASE("gradcomp::hook_bucket");
      task();
    });
  };
  o.carry_context = &with_profiler_context;
  return o;
}

uint64_t ddp_bucket_identity(int64_t index, const at::Tensor& buffer,
                             const std::vector<std::vector<int64_t>>& param_shapes) {
  return bucket_identity(index, buffer.numel(), to_dtype(buffer.scalar_type(), "DDP bucket"),
                         param_shapes);
}

namespace {

EngineOptions with_world(EngineOptions o, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                         const NodeProcessGroups& nodes) {
  GRADCOMP_TORCH_CHECK(group, "the DDP model has no process group");
  GRADCOMP_TORCH_CHECK(!nodes.intra_node == !nodes.inter_node,
                       "node process groups need both the intra-node and the inter-node group");
  o.world_size = group->getSize();
  // Without compression the node groups go unused (the plain allreduce of all ranks).
  o.local_world_size = nodes.intra_node && o.compress ? nodes.intra_node->getSize() : 1;
  return o;
}

}  // namespace

DdpHook::DdpHook(c10::intrusive_ptr<c10d::ProcessGroup> group, EngineOptions options,
                 std::chrono::milliseconds timeout, FaultSpec fault, NodeProcessGroups nodes,
                 std::string shm_name)
    : group_(std::move(group)),
      compress_(options.compress),
      kernels_(options.config.kernels),
      timeout_(timeout),
      fault_(std::move(fault)),
      nodes_(std::move(nodes)),
      shm_name_(std::move(shm_name)),
      engine_(
          call_core([&] { return BucketEngine(with_world(std::move(options), group_, nodes_)); })) {
}

void DdpHook::bind(const at::Tensor& bucket) {
  std::lock_guard<std::mutex> lock(bind_mu_);
  const at::Device device = bucket.device();
  if (device_) {
    GRADCOMP_TORCH_CHECK(*device_ == device, "DDP bucket on ", device, " but this hook works on ",
                         *device_, " (its first bucket's device); register one hook per device");
    return;
  }
  comm_ = std::make_unique<ProcessGroupCommunicator>(group_, device, timeout_);
  Communicator* transport = comm_.get();
  if (fault_.action != FaultSpec::Action::kNone) {
    faulty_ =
        call_core([&] { return std::make_unique<FaultInjectingCommunicator>(*comm_, fault_); });
    transport = faulty_.get();
  }
  if (compress_ && device.is_cpu())
    backend_ = std::make_unique<ProfiledBackend>(make_cpu_backend(1));
#if defined(GRADCOMP_HAVE_CUDA)
  if (device.is_cuda()) {
    // One high-priority stream of this hook runs every bucket's encode, collectives and decode.
    cuda_stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index()).unwrap();
    if (compress_) {
      cuda::CudaBackendOptions o;
      o.device = device.index();
      o.stream = c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, *cuda_stream_).stream();
      o.kernels = kernels_;
      backend_ =
          std::make_unique<ProfiledBackend>(call_core([&] { return cuda::make_cuda_backend(o); }));
    }
  }
#endif
  NodeGroups groups;
  // Without compression every bucket takes the plain allreduce: no node groups are used.
  if (nodes_.intra_node && compress_) {
    node_comms_ = call_core([&] {
      return node_communicators(nodes_.intra_node, nodes_.inter_node, device, timeout_, shm_name_);
    });
    groups = node_comms_.groups();
  }
  call_core([&] { engine_.bind(*transport, backend_.get(), groups); });
  device_ = device;
}

void DdpHook::set_parameters(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(params_mu_);
  param_index_.clear();
  for (size_t i = 0; i < params.size(); ++i)
    param_index_.emplace(params[i].unsafeGetTensorImpl(), static_cast<int64_t>(i));
}

int64_t DdpHook::param_index(const at::Tensor& param) const {
  std::lock_guard<std::mutex> lock(params_mu_);
  auto it = param_index_.find(param.unsafeGetTensorImpl());
  return it == param_index_.end() ? -1 : it->second;
}

BucketRequest DdpHook::request(const at::Tensor& bucket, int64_t index, uint64_t identity,
                               bool is_last, std::vector<ParamSlice> params) const {
  BucketRequest r;
  r.data = bucket.data_ptr();
  r.numel = bucket.numel();
  r.dtype = to_dtype(bucket.scalar_type(), "DDP bucket");
  r.index = index;
  r.identity = identity;
  r.is_last = is_last;
  r.params = std::move(params);
  return r;
}

c10::intrusive_ptr<c10::ivalue::Future> DdpHook::submit(at::Tensor bucket, int64_t index,
                                                        uint64_t identity, bool is_last,
                                                        std::vector<ParamSlice> params) {
  check_gradient_tensor(bucket, "DDP bucket");
  bind(bucket);
  BucketRequest r = request(bucket, index, identity, is_last, std::move(params));
#if defined(GRADCOMP_HAVE_CUDA)
  if (bucket.is_cuda()) {
    // Ordered after the stream that filled the bucket. Nothing here waits for the device: the
    // future is made with the device and completed while the compression stream is current, so
    // it records CUDA events there and the reducer's wait orders its stream after them.
    auto future = c10::make_intrusive<c10::ivalue::Future>(
        c10::TensorType::get(), std::vector<c10::Device>{bucket.device()});
    c10::cuda::CUDAStream filled = c10::cuda::getCurrentCUDAStream(bucket.device().index());
    c10::cuda::CUDAStream compress(c10::cuda::CUDAStream::UNCHECKED, *cuda_stream_);
    c10::cuda::CUDAStreamGuard guard(compress);
    compat::CudaEvent ready;
    ready.record(filled);
    ready.block(compress);
    bucket.record_stream(compress);
    engine_.reduce(r, [future, bucket](std::exception_ptr error) {
      if (error) {
        future->setError(std::move(error));
      } else {
        future->markCompleted(c10::IValue(bucket));
      }
    });
    return future;
  }
#endif
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  call_core([&] {
    engine_.submit(std::move(r), [future, bucket](std::exception_ptr error) {
      if (error) {
        future->setError(std::move(error));
      } else {
        future->markCompleted(c10::IValue(bucket));
      }
    });
  });
  return future;
}

void DdpHook::reduce(at::Tensor bucket, int64_t index, uint64_t identity, bool is_last) {
  check_gradient_tensor(bucket, "DDP bucket");
  bind(bucket);
  const BucketRequest r = request(bucket, index, identity, is_last, {});
#if defined(GRADCOMP_HAVE_CUDA)
  if (bucket.is_cuda()) {
    c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(bucket.device().index());
    c10::cuda::CUDAStream compress(c10::cuda::CUDAStream::UNCHECKED, *cuda_stream_);
    compat::CudaEvent ready, reduced;
    ready.record(current);
    ready.block(compress);
    bucket.record_stream(compress);
    {
      c10::cuda::CUDAStreamGuard guard(compress);
      call_core([&] { engine_.reduce(r); });
      reduced.record(compress);
    }
    reduced.block(current);
    return;
  }
#endif
  call_core([&] { engine_.reduce(r); });
}

c10::intrusive_ptr<c10::ivalue::Future> GradcompCommHook::runHook(c10d::GradBucket& bucket) {
  std::vector<std::vector<int64_t>> shapes;
  const std::vector<at::Tensor> params = bucket.getParameters();
  for (const at::Tensor& p : params) shapes.push_back(p.sizes().vec());
  at::Tensor& buffer = bucket.getBufferRef();
  const int64_t index = static_cast<int64_t>(bucket.getIndex());
  const uint64_t id = ddp_bucket_identity(index, buffer, shapes);
  std::vector<ParamSlice> slices;
  const std::vector<at::Tensor> grads = bucket.getGradients();
  const auto* base = static_cast<const char*>(buffer.data_ptr());
  for (size_t i = 0; i < params.size() && i < grads.size(); ++i) {
    const int64_t position = hook_->param_index(params[i]);
    if (position < 0) {
      slices.clear();  // parameters unknown (set_parameters not called): no layout recorded
      break;
    }
    const int64_t offset =
        (static_cast<const char*>(grads[i].data_ptr()) - base) / buffer.element_size();
    slices.push_back({position, offset, grads[i].numel()});
  }
  return hook_->submit(buffer, index, id, bucket.isLast(), std::move(slices));
}

at::Tensor GradcompCommHook::parseHookResult(const c10::IValue& result) {
  return result.isTensor() ? result.toTensor() : result.toTensorVector()[0];
}

}  // namespace torch_ext
}  // namespace gradcomp
