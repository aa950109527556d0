// DiLoCo over a c10d group: gradcomp::OuterSync on the parameters' device, and its checkpoints.
#include <cstring>
#include <optional>
#include <utility>

#include "diloco_state.h"
#include "gradcomp/torch.h"
#include "parameter_agreement.h"
#include "process_group_communicator.h"
#include "tensor_params.h"
#include "torch_compat.h"

#if defined(GRADCOMP_HAVE_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gradcomp {
namespace torch_ext {
namespace {

// 2 adds the round in flight (overlap_steps > 0), 3 its eager anchor (empty without eager);
// states of formats 1 and 2, which hold neither, load.
constexpr int64_t kStateFormat = 3;

at::Tensor scalar(int64_t v) {
  return at::tensor({v}, at::TensorOptions().dtype(at::kLong));
}

at::Tensor bytes_tensor(const std::vector<uint8_t>& b) {
  at::Tensor t = at::empty({static_cast<int64_t>(b.size())}, at::kByte);
  if (!b.empty()) std::memcpy(t.data_ptr<uint8_t>(), b.data(), b.size());
  return t;
}

at::Tensor floats_tensor(const std::vector<float>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kFloat);
  if (!v.empty()) std::memcpy(t.data_ptr<float>(), v.data(), v.size() * sizeof(float));
  return t;
}

at::Tensor ids_tensor(const std::map<uint64_t, std::vector<uint8_t>>& m) {
  std::vector<int64_t> ids;
  for (const auto& kv : m) ids.push_back(static_cast<int64_t>(kv.first));
  return at::tensor(ids, at::TensorOptions().dtype(at::kLong));
}

at::Tensor checked(const at::Tensor& t, at::ScalarType type, const std::string& name) {
  GRADCOMP_CHECK(t.defined() && t.scalar_type() == type && t.dim() == 1,
                 "DiLoCo state: " << name << " is not a 1-D " << c10::toString(type) << " tensor");
  return t.contiguous().cpu();
}

}  // namespace

std::map<std::string, at::Tensor> outer_state_tensors(const OuterSyncState& s, int world_size) {
  std::map<std::string, at::Tensor> m;
  m["format"] = scalar(kStateFormat);
  m["world_size"] = scalar(world_size);
  m["inner_steps"] = scalar(s.inner_steps);
  m["inner_step"] = scalar(static_cast<int64_t>(s.inner_step));
  std::vector<int64_t> rounds(s.rounds.begin(), s.rounds.end());
  m["rounds"] = at::tensor(rounds, at::TensorOptions().dtype(at::kLong));
  for (size_t f = 0; f < s.anchors.size(); ++f) {
    m["anchor." + std::to_string(f)] = floats_tensor(s.anchors[f]);
    m["momentum." + std::to_string(f)] = floats_tensor(s.momenta[f]);
  }
  // The round in flight, finished by state() and merged at its step after a load: none or one.
  std::vector<int64_t> pending;
  for (const OuterPendingRound& p : s.pending) {
    pending.insert(pending.end(), {static_cast<int64_t>(p.fragment),
                                   static_cast<int64_t>(p.merge_step), p.finite ? 1 : 0});
    const std::string index = std::to_string(pending.size() / 3 - 1);
    m["pending_mean." + index] = floats_tensor(p.mean);
    m["pending_eager." + index] = floats_tensor(p.eager);
  }
  m["pending"] = at::tensor(pending, at::TensorOptions().dtype(at::kLong));
  m["seed"] = scalar(static_cast<int64_t>(s.compression.seed));
  m["residual_ids"] = ids_tensor(s.compression.residuals);
  m["chunk_residual_ids"] = ids_tensor(s.compression.chunk_residuals);
  for (const auto& kv : s.compression.residuals)
    m["residual." + std::to_string(kv.first)] = bytes_tensor(kv.second);
  for (const auto& kv : s.compression.chunk_residuals)
    m["chunk_residual." + std::to_string(kv.first)] = bytes_tensor(kv.second);
  return m;
}

OuterSyncState outer_state_from_tensors(const std::function<at::Tensor(const std::string&)>& get,
                                        int world_size) {
  auto one = [&](const std::string& name) {
    const at::Tensor t = checked(get(name), at::kLong, name);
    GRADCOMP_CHECK(t.numel() == 1,
                   "DiLoCo state: " << name << " holds " << t.numel() << " values, not one");
    return t.item<int64_t>();
  };
  const int64_t format = one("format");
  GRADCOMP_CHECK(format >= 1 && format <= kStateFormat, "not a gradcomp DiLoCo state of format "
                                                            << kStateFormat << " (its format is "
                                                            << format << ")");
  // A count the core keeps in `bits` bits, or an error naming it.
  auto count = [](int64_t v, const std::string& name, int bits) {
    GRADCOMP_CHECK(v >= 0 && (bits >= 63 || v < (int64_t{1} << bits)),
                   "DiLoCo state: " << name << " is " << v << ", not a count");
    return v;
  };
  OuterSyncState s;
  s.inner_steps = static_cast<uint32_t>(count(one("inner_steps"), "inner_steps", 32));
  s.inner_step = static_cast<uint64_t>(count(one("inner_step"), "inner_step", 63));
  const at::Tensor rounds = checked(get("rounds"), at::kLong, "rounds");
  for (int64_t f = 0; f < rounds.numel(); ++f) {
    s.rounds.push_back(static_cast<uint32_t>(
        count(rounds[f].item<int64_t>(), "rounds[" + std::to_string(f) + "]", 32)));
    for (const char* kind : {"anchor.", "momentum."}) {
      const std::string name = kind + std::to_string(f);
      const at::Tensor t = checked(get(name), at::kFloat, name);
      std::vector<float> v(static_cast<size_t>(t.numel()));
      if (!v.empty()) std::memcpy(v.data(), t.data_ptr<float>(), v.size() * sizeof(float));
      (kind[0] == 'a' ? s.anchors : s.momenta).push_back(std::move(v));
    }
  }
  if (format >= 2) {
    const at::Tensor pending = checked(get("pending"), at::kLong, "pending");
    GRADCOMP_CHECK(pending.numel() % 3 == 0,
                   "DiLoCo state: pending holds " << pending.numel() << " values, not triples");
    for (int64_t i = 0; i < pending.numel() / 3; ++i) {
      OuterPendingRound p;
      p.fragment =
          static_cast<uint32_t>(count(pending[3 * i].item<int64_t>(), "pending fragment", 32));
      p.merge_step = static_cast<uint64_t>(
          count(pending[3 * i + 1].item<int64_t>(), "pending merge step", 63));
      p.finite = pending[3 * i + 2].item<int64_t>() != 0;
      const std::string name = "pending_mean." + std::to_string(i);
      const at::Tensor t = checked(get(name), at::kFloat, name);
      p.mean.resize(static_cast<size_t>(t.numel()));
      if (!p.mean.empty())
        std::memcpy(p.mean.data(), t.data_ptr<float>(), p.mean.size() * sizeof(float));
      if (format >= 3) {
        const std::string eager = "pending_eager." + std::to_string(i);
        const at::Tensor e = checked(get(eager), at::kFloat, eager);
        p.eager.resize(static_cast<size_t>(e.numel()));
        if (!p.eager.empty())
          std::memcpy(p.eager.data(), e.data_ptr<float>(), p.eager.size() * sizeof(float));
      }
      s.pending.push_back(std::move(p));
    }
  }
  s.compression.seed = static_cast<uint64_t>(one("seed"));
  auto residuals = [&](const std::string& kind, std::map<uint64_t, std::vector<uint8_t>>& out) {
    const at::Tensor ids = checked(get(kind + "_ids"), at::kLong, kind + "_ids");
    for (int64_t i = 0; i < ids.numel(); ++i) {
      count(ids[i].item<int64_t>(), kind + "_ids[" + std::to_string(i) + "]", 63);
      const std::string name = kind + "." + std::to_string(ids[i].item<int64_t>());
      const at::Tensor t = checked(get(name), at::kByte, name);
      std::vector<uint8_t> b(static_cast<size_t>(t.numel()));
      if (!b.empty()) std::memcpy(b.data(), t.data_ptr<uint8_t>(), b.size());
      out[static_cast<uint64_t>(ids[i].item<int64_t>())] = std::move(b);
    }
  };
  residuals("residual", s.compression.residuals);
  residuals("chunk_residual", s.compression.chunk_residuals);
  const int64_t saved = one("world_size");
  GRADCOMP_CHECK(saved == world_size ||
                     (s.compression.residuals.empty() && s.compression.chunk_residuals.empty()),
                 "DiLoCo state saved by a group of " << saved << " ranks, this group has "
                                                     << world_size
                                                     << ": the residuals cannot be regrouped");
  return s;
}

}  // namespace torch_ext

struct DiLoCo::Impl {
  Impl(std::vector<at::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> group,
       const CodecSpec& codec, DiLoCoOptions options)
      : params_(std::move(params)), group_(std::move(group)), options_(std::move(options)) {
    options_.outer.validate();  // before any collective, so a bad option fails alike everywhere
    if (options_.warn_short_run) {
      const std::string warning = short_run_warning(
          outer_defaults_kept(options_.outer), options_.outer.inner_steps, options_.planned_steps);
      if (!warning.empty()) TORCH_WARN(warning);
    }
    GRADCOMP_CHECK(!params_.empty(), "DiLoCo: no parameters");
    GRADCOMP_CHECK(group_, "DiLoCo: no process group");
    const EngineOptions engine = engine_options(codec);
    codec_name_ = codec_spec_name(codec);
    kernels_ = engine.config.kernels;
    GRADCOMP_CHECK(engine.compress,
                   "DiLoCo sends its outer gradients through gradcomp's "
                   "compressed allreduce: the codec must be Q4, Q2 or TopK");
    device_ = params_[0].device();
    std::vector<OuterParam> outer;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = params_[i];
      GRADCOMP_CHECK(p.device() == device_, "DiLoCo: parameter " << i << " is on " << p.device()
                                                                 << ", parameter 0 on " << device_);
      GRADCOMP_CHECK(p.is_contiguous() && p.layout() == at::kStrided,
                     "DiLoCo: parameter " << i << " is not a contiguous dense tensor");
      outer.push_back(
          {p.data_ptr(), p.numel(), torch_ext::to_dtype(p.scalar_type(), "DiLoCo parameter")});
      data_.push_back(p.data_ptr());
    }
    torch_ext::check_same_model_on_every_rank(params_, *group_, device_, "DiLoCo");
    if (options_.broadcast_parameters) torch_ext::broadcast_parameters(params_, *group_);
    comm_ = std::make_unique<torch_ext::ProcessGroupCommunicator>(group_, device_,
                                                                  options_.collective_timeout);
    if (device_.is_cpu()) backend_ = make_cpu_backend(1);
#if defined(GRADCOMP_HAVE_CUDA)
    if (device_.is_cuda()) {
      // A stream of its own; step() orders it after the stream the optimizer stepped on, and that
      // stream after the parameters it writes back.
      stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index()).unwrap();
      cuda::CudaBackendOptions o;
      o.device = device_.index();
      o.stream = c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, *stream_).stream();
      o.kernels = kernels_;
      backend_ = cuda::make_cuda_backend(o);
      // The broadcast above is ordered on the current stream only (NCCL's wait() does not block
      // the host), and OuterSync reads the anchors on this stream: without the event, ranks other
      // than 0 could take their own initial weights as anchors and diverge for good.
      torch_ext::compat::CudaEvent broadcast_done;
      broadcast_done.record(c10::cuda::getCurrentCUDAStream(device_.index()));
      broadcast_done.block(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, *stream_));
    }
#endif
    GRADCOMP_CHECK(backend_,
                   "DiLoCo: parameters are on " << device_ << ", which this build cannot use");
    NodeProcessGroups nodes = options_.node_groups;
    if (!nodes.intra_node && options_.local_world_size != 1) {
      const auto timeout = options_.collective_timeout.count() > 0
                               ? options_.collective_timeout
                               : std::chrono::milliseconds(std::chrono::seconds(60));
      nodes = split_node_groups(group_, options_.local_world_size,
                                device_.is_cuda() ? "nccl" : "gloo", timeout);
    }
    if (nodes.intra_node) {
      GRADCOMP_CHECK(nodes.inter_node, "DiLoCo: node_groups needs the inter-node group too");
      node_comms_ = torch_ext::node_communicators(nodes.intra_node, nodes.inter_node, device_,
                                                  options_.collective_timeout, std::string());
      sync_ = std::make_unique<OuterSync>(node_comms_.groups(), *backend_, engine.config,
                                          options_.outer, std::move(outer));
    } else {
      sync_ = std::make_unique<OuterSync>(*comm_, *backend_, engine.config, options_.outer,
                                          std::move(outer));
    }
#if defined(GRADCOMP_HAVE_CUDA)
    if (device_.is_cuda()) {
      // overlap_steps > 0 (v2): a background round runs on a thread of OuterSync, where the
      // backend's device and stream are made current, so that c10d orders the round's collectives
      // after the kernels that encoded them. step() orders that stream after the inner step that
      // produced the parameters, and the training stream after the merge.
      const c10::Stream own = *stream_;
      sync_->set_round_thread_setup([own] {
        c10::cuda::set_device(own.device_index());
        c10::cuda::setCurrentCUDAStream(
            c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, own));
      });
    }
#endif
  }

  std::vector<at::Tensor> params_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  DiLoCoOptions options_;
  std::string codec_name_;
  KernelGeneration kernels_ = KernelGeneration::kDefault;
  at::Device device_ = at::kCPU;
  std::unique_ptr<torch_ext::ProcessGroupCommunicator> comm_;
  torch_ext::NodeCommunicators node_comms_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<OuterSync> sync_;
  std::vector<const void*> data_;      // each parameter's memory when the DiLoCo was made
  std::optional<c10::Stream> stream_;  // CUDA: the backend's stream
};

DiLoCo::DiLoCo(std::vector<at::Tensor> parameters, c10::intrusive_ptr<c10d::ProcessGroup> group,
               CodecSpec codec, DiLoCoOptions options)
    : impl_(std::make_unique<Impl>(std::move(parameters), std::move(group), codec,
                                   std::move(options))) {}

DiLoCo::DiLoCo(const torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group,
               CodecSpec codec, DiLoCoOptions options)
    : DiLoCo(module.parameters(), std::move(group), codec, std::move(options)) {}

DiLoCo::~DiLoCo() = default;

int DiLoCo::step() {
  at::NoGradGuard no_grad;
  Impl& d = *impl_;
  for (size_t i = 0; i < d.params_.size(); ++i)
    GRADCOMP_CHECK(d.params_[i].data_ptr() == d.data_[i],
                   "DiLoCo: parameter " << i << " now lives elsewhere in memory (its .data was "
                                        << "replaced, or a state dict was loaded with assign=True) "
                                        << "since the DiLoCo was made; make it after that");
#if defined(GRADCOMP_HAVE_CUDA)
  if (d.device_.is_cuda()) {
    c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(d.device_.index());
    c10::cuda::CUDAStream own(c10::cuda::CUDAStream::UNCHECKED, *d.stream_);
    torch_ext::compat::CudaEvent stepped, synced;
    stepped.record(current);
    stepped.block(own);
    int done = 0;
    {
      // c10d orders its collectives after the current stream: the backend's, while it runs.
      c10::cuda::CUDAStreamGuard guard(own);
      done = d.sync_->step();
    }
    synced.record(own);
    synced.block(current);
    return done;
  }
#endif
  return d.sync_->step();
}

OuterSyncStats DiLoCo::stats() const {
  return impl_->sync_->stats();
}

std::string DiLoCo::metrics_text() const {
  const OuterSyncStats d = stats();
  ReductionStats r;
  r.buckets = r.compressed_buckets = d.rounds;
  r.bytes_sent = d.bytes_sent;
  r.uncompressed_bytes = d.uncompressed_bytes;
  r.nonfinite_buckets = d.nonfinite_rounds;
  r.steps = d.inner_steps;
  r.comm_seconds = d.seconds;  // what the caller waited: with overlap, the exposed part
  return prometheus_text(r, metric_labels(rank(), impl_->codec_name_, "diloco"));
}

void DiLoCo::write_metrics(const std::string& path) const {
  write_file_atomically(path, metrics_text());
}

std::vector<std::vector<int64_t>> DiLoCo::fragments() const {
  std::vector<std::vector<int64_t>> out;
  for (uint32_t f = 0; f < impl_->sync_->fragments(); ++f)
    out.push_back(impl_->sync_->fragment_params(f));
  return out;
}

int DiLoCo::rank() const {
  return impl_->group_->getRank();
}

int DiLoCo::world_size() const {
  return impl_->group_->getSize();
}

bool DiLoCo::flush() {
  at::NoGradGuard no_grad;
  return impl_->sync_->flush();
}

OuterSyncState DiLoCo::state() const {
  return impl_->sync_->state();
}

void DiLoCo::load_state(const OuterSyncState& state) {
  impl_->sync_->load_state(state);
}

void DiLoCo::save(torch::serialize::OutputArchive& archive) const {
  for (const auto& kv : torch_ext::outer_state_tensors(state(), world_size()))
    archive.write("gradcomp_diloco." + kv.first, kv.second);
}

void DiLoCo::load(torch::serialize::InputArchive& archive) {
  load_state(torch_ext::outer_state_from_tensors(
      [&](const std::string& name) {
        at::Tensor t;
        GRADCOMP_CHECK(archive.try_read("gradcomp_diloco." + name, t),
                       "DiLoCo checkpoint: no gradcomp_diloco." << name);
        return t;
      },
      world_size()));
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const DiLoCo& diloco) {
  diloco.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           DiLoCo& diloco) {
  diloco.load(archive);
  return archive;
}

}  // namespace gradcomp
