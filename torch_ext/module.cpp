// gradcomp._C: Python bindings for the DDP hook and its install on DDP's reducer, GradSync, and
// the FSDP2 collectives (the int8 all-gathers' in all_gather_bindings.cpp).
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "bindings.h"
#include "ddp_hook.h"
#include "diloco_state.h"
#include "fsdp_collectives.h"
#include "tensor_params.h"
#include "torch_compat.h"

namespace py = pybind11;

// Found by gradcomp/_torch_compat.py in the file's bytes, before the module is loaded.
extern "C" __attribute__((used, visibility("default"))) const char gradcomp_built_for_torch[] =
    "gradcomp-built-for-torch=" GRADCOMP_BUILT_FOR_TORCH ";";

namespace gradcomp {
namespace torch_ext {

DType parse_dtype(const std::string& name, const char* what) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  GRADCOMP_TORCH_CHECK(false, what, " must be 'float32', 'float16' or 'bfloat16', got '", name,
                       "'");
}

// The hook's deadline for one collective, "timeout" in seconds (absent or None: the process
// group's).
std::chrono::milliseconds parse_timeout(const py::dict& d) {
  if (!d.contains("timeout") || d["timeout"].is_none()) return std::chrono::milliseconds(0);
  const double seconds = d["timeout"].cast<double>();
  GRADCOMP_TORCH_CHECK(seconds > 0 && seconds < 1e7, "timeout must be positive seconds, got ",
                       seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

namespace {

// The spec's "kernels" ("default", "v1" or "v2"; absent: "default").
KernelGeneration parse_kernels(const py::dict& d) {
  const std::string name = d.contains("kernels") ? d["kernels"].cast<std::string>() : "default";
  return call_core([&] { return parse_kernel_generation(name, "codec option kernels"); });
}

// A Python codec spec's options (gradcomp.Q4 / TopK / Q2 / NoCompression ._options()) as the C++
// spec.
CodecSpec parse_codec(const py::dict& d) {
  const std::string codec = d["codec"].cast<std::string>();
  if (codec == "q4") {
    Q4 q4;
    q4.block_size = d["block_size"].cast<int>();
    q4.rounding =
        d["rounding"].cast<std::string>() == "nearest" ? Rounding::kNearest : Rounding::kStochastic;
    q4.algorithm = d["algorithm"].cast<std::string>() == "one_phase" ? Q4Algorithm::kOnePhase
                                                                     : Q4Algorithm::kTwoPhase;
    q4.error_feedback = d["error_feedback"].cast<bool>();
    q4.residual_dtype = parse_dtype(d["residual_dtype"].cast<std::string>(), "residual_dtype");
    q4.seed = d["seed"].cast<uint64_t>();
    q4.piece_numel = d["piece_numel"].cast<int64_t>();
    q4.kernels = parse_kernels(d);
    return q4;
  }
  if (codec == "topk") {
    TopK topk;
    topk.ratio = d["ratio"].cast<double>();
    topk.exact = d["exact"].cast<bool>();
    topk.error_feedback = d["error_feedback"].cast<bool>();
    topk.value_dtype = parse_dtype(d["value_dtype"].cast<std::string>(), "value_dtype");
    topk.residual_dtype = parse_dtype(d["residual_dtype"].cast<std::string>(), "residual_dtype");
    topk.seed = d["seed"].cast<uint64_t>();
    topk.warmup_steps = d["warmup_steps"].cast<uint32_t>();
    topk.warmup_stages = d["warmup_stages"].cast<uint32_t>();
    const std::string warmup = d["warmup"].cast<std::string>();
    GRADCOMP_TORCH_CHECK(warmup == "sparsity" || warmup == "q4",
                         "TopK warmup must be 'sparsity' or 'q4', got '", warmup, "'");
    topk.warmup = warmup == "q4" ? TopKWarmup::kQ4 : TopKWarmup::kSparsity;
    topk.momentum = d["momentum"].cast<float>();
    topk.momentum_masking = d["momentum_masking"].cast<bool>();
    topk.clip_norm = d["clip_norm"].cast<float>();
    topk.piece_numel = d["piece_numel"].cast<int64_t>();
    topk.kernels = parse_kernels(d);
    return topk;
  }
  if (codec == "q2") {
    Q2 q2;
    q2.block_size = d["block_size"].cast<int>();
    q2.rounding =
        d["rounding"].cast<std::string>() == "nearest" ? Rounding::kNearest : Rounding::kStochastic;
    q2.error_feedback = d["error_feedback"].cast<bool>();
    q2.residual_dtype = parse_dtype(d["residual_dtype"].cast<std::string>(), "residual_dtype");
    q2.seed = d["seed"].cast<uint64_t>();
    q2.piece_numel = d["piece_numel"].cast<int64_t>();
    q2.kernels = parse_kernels(d);
    return q2;
  }
  GRADCOMP_TORCH_CHECK(codec == "none", "unknown codec '", codec, "'");
  return NoCompression{};
}

// For tests: a transport fault to inject, as a dict of FaultSpec's fields.
FaultSpec parse_fault(const py::dict& d) {
  FaultSpec f;
  if (!d.contains("fault") || d["fault"].is_none()) return f;
  const py::dict spec = d["fault"].cast<py::dict>();
  f.action = call_core([&] { return FaultSpec::parse_action(spec["action"].cast<std::string>()); });
  if (spec.contains("collective")) f.collective = spec["collective"].cast<std::string>();
  if (spec.contains("call")) f.call = spec["call"].cast<uint64_t>();
  if (spec.contains("rank")) f.rank = spec["rank"].cast<int>();
  if (spec.contains("after")) f.after = spec["after"].cast<bool>();
  if (spec.contains("pause_file")) f.pause_file = spec["pause_file"].cast<std::string>();
  return f;
}

py::dict stats_dict(const ReductionStats& s) {
  py::dict d;
  d["buckets"] = s.buckets;
  d["compressed_buckets"] = s.compressed_buckets;
  d["bytes_sent"] = s.bytes_sent;
  d["inter_node_bytes"] = s.inter_node_bytes;
  d["uncompressed_bytes"] = s.uncompressed_bytes;
  d["ratio"] = s.bytes_sent > 0 ? static_cast<double>(s.uncompressed_bytes) / s.bytes_sent : 0.0;
  d["codec_seconds"] = s.codec_seconds;
  d["comm_seconds"] = s.comm_seconds;
  d["nonfinite_buckets"] = s.nonfinite_buckets;
  d["overlapped_buckets"] = s.overlapped_buckets;
  d["max_queued"] = s.max_queued;
  d["steps"] = s.steps;
  d["buckets_in_backward"] = s.buckets_in_backward;
  d["failed_buckets"] = s.failed_buckets;
  d["failed_steps"] = s.failed_steps;
  d["rejected_payloads"] = s.rejected_payloads;
  d["residual_bytes"] = s.residual_bytes;
  return d;
}

py::dict residual_dict(const std::map<uint64_t, std::vector<uint8_t>>& m) {
  py::dict d;
  for (const auto& kv : m) {
    at::Tensor t = at::empty({static_cast<int64_t>(kv.second.size())}, at::kByte);
    if (!kv.second.empty()) std::memcpy(t.data_ptr<uint8_t>(), kv.second.data(), kv.second.size());
    d[py::int_(kv.first)] = t;
  }
  return d;
}

std::map<uint64_t, std::vector<uint8_t>> residual_map(const py::dict& d) {
  std::map<uint64_t, std::vector<uint8_t>> m;
  for (auto item : d) {
    at::Tensor t = item.second.cast<at::Tensor>().contiguous().cpu();
    GRADCOMP_TORCH_CHECK(t.scalar_type() == at::kByte,
                         "state_dict residuals must be uint8 tensors");
    std::vector<uint8_t> bytes(static_cast<size_t>(t.numel()));
    if (!bytes.empty()) std::memcpy(bytes.data(), t.data_ptr<uint8_t>(), bytes.size());
    m[item.first.cast<uint64_t>()] = std::move(bytes);
  }
  return m;
}

// An FSDP collective over `group` with the codec of `options` (Q4 or TopK).
template <typename Collective>
std::shared_ptr<Collective> make_fsdp_collective(py::object group, const py::dict& options) {
  const EngineOptions o = call_core([&] {
    const CodecSpec codec = parse_codec(options);
    check_per_step_codec(codec, "FSDP");
    return engine_options(codec);
  });
  GRADCOMP_TORCH_CHECK(o.compress,
                       "FSDP's compressed collectives need a codec (Q4 or TopK); without "
                       "compression use FSDP's own");
  return std::make_shared<Collective>(group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>(),
                                      o.config, parse_timeout(options));
}

// Destroyed without the GIL: the destructor joins the worker, which may be finishing a bucket
// whose future runs (or drops) a Python callback of the standard route's then(), and needs it.
// A deleter rather than pybind11 3's release_gil_before_calling_cpp_dtor, so that every torch's
// pybind11 takes it; the last owner may also be DDP's reducer, dropped on a thread without it.
template <typename T>
std::shared_ptr<T> released_without_gil(T* object) {
  return std::shared_ptr<T>(object, [](T* p) {
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      delete p;
    } else {
      delete p;
    }
  });
}

}  // namespace
}  // namespace torch_ext
}  // namespace gradcomp

PYBIND11_MODULE(_C, m) {
  using namespace gradcomp::torch_ext;
  using gradcomp::BucketLayout;
  using gradcomp::DType;
  using gradcomp::EngineState;
  m.doc() = "gradcomp C++ extension: compressed DDP communication hook and codec ops";
  m.def(
      "check_worker_cpus",
      [](const std::string& spec) { call_core([&] { gradcomp::check_worker_cpus(spec); }); },
      py::arg("spec"));
  py::class_<DdpHook, std::shared_ptr<DdpHook>>(m, "DdpHook")
      .def(py::init([](py::object group, const py::dict& options, py::object intra_node,
                       py::object inter_node, const std::string& shm_name) {
             auto pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             gradcomp::NodeProcessGroups nodes;
             if (!intra_node.is_none()) {
               nodes.intra_node = intra_node.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
               nodes.inter_node = inter_node.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             }
             gradcomp::EngineOptions engine = ddp_engine_options(parse_codec(options));
             if (options.contains("worker_cpus"))
               engine.worker_cpus = options["worker_cpus"].cast<std::string>();
             return released_without_gil(new DdpHook(pg, std::move(engine), parse_timeout(options),
                                                     parse_fault(options), std::move(nodes),
                                                     shm_name));
           }),
           py::arg("process_group"), py::arg("options"), py::arg("intra_node") = py::none(),
           py::arg("inter_node") = py::none(), py::arg("shm_name") = "")
      .def(
          "reduce_bucket",
          [](DdpHook& hook, at::Tensor bucket, int64_t index,
             const std::vector<std::vector<int64_t>>& shapes, bool is_last) {
            const uint64_t id = ddp_bucket_identity(index, bucket, shapes);
            py::gil_scoped_release release;
            hook.reduce(bucket, index, id, is_last);
            return bucket;
          },
          py::arg("bucket"), py::arg("index"), py::arg("param_shapes"), py::arg("is_last") = false)
      .def(
          "submit_bucket",
          [](DdpHook& hook, at::Tensor bucket, int64_t index,
             const std::vector<std::vector<int64_t>>& shapes, bool is_last) {
            const uint64_t id = ddp_bucket_identity(index, bucket, shapes);
            c10::intrusive_ptr<c10::ivalue::Future> future;
            {
              py::gil_scoped_release release;
              future = hook.submit(bucket, index, id, is_last, {});
            }
            return std::make_shared<torch::jit::PythonFutureWrapper>(std::move(future));
          },
          py::arg("bucket"), py::arg("index"), py::arg("param_shapes"), py::arg("is_last") = false)
      .def("last_step_stats",
           [](const DdpHook& h) { return stats_dict(h.engine().last_step_stats()); })
      .def("total_stats", [](const DdpHook& h) { return stats_dict(h.engine().total_stats()); })
      .def(
          "metrics_text",
          [](const DdpHook& h, int rank, const std::string& codec) {
            return gradcomp::prometheus_text(h.engine().total_stats(),
                                             gradcomp::metric_labels(rank, codec, "ddp"));
          },
          py::arg("rank"), py::arg("codec"))
      .def("world_size", &DdpHook::world_size)
      .def("worker_cpus", [](const DdpHook& h) { return h.engine().worker_cpus(); })
      .def("worker_placement", [](const DdpHook& h) { return h.engine().worker_placement(); })
      .def("state_dict",
           [](const DdpHook& h) {
             const EngineState s = h.engine().state();
             py::dict d;
             d["format"] = 1;
             d["seed"] = s.compression.seed;
             d["step"] = s.compression.step;
             d["started"] = s.started;
             d["world_size"] = s.world_size;
             d["local_world_size"] = s.local_world_size;
             d["residuals"] = residual_dict(s.compression.residuals);
             d["chunk_residuals"] = residual_dict(s.compression.chunk_residuals);
             d["velocities"] = residual_dict(s.compression.velocities);
             py::dict layouts;
             for (const auto& [id, layout] : s.layouts) {
               py::dict l;
               l["index"] = layout.index;
               l["dtype"] = static_cast<int>(layout.dtype);
               l["params"] = layout.params;
               layouts[py::int_(id)] = l;
             }
             d["layouts"] = layouts;
             return d;
           })
      .def("load_state_dict",
           [](DdpHook& h, const py::dict& d) {
             GRADCOMP_TORCH_CHECK(d.contains("format") && d["format"].cast<int>() == 1,
                                  "not a gradcomp hook state_dict (format 1)");
             EngineState s;
             s.compression.seed = d["seed"].cast<uint64_t>();
             s.compression.step = d["step"].cast<uint32_t>();
             s.compression.residuals = residual_map(d["residuals"].cast<py::dict>());
             s.compression.chunk_residuals = residual_map(d["chunk_residuals"].cast<py::dict>());
             if (d.contains("velocities"))
               s.compression.velocities = residual_map(d["velocities"].cast<py::dict>());
             s.started = d["started"].cast<bool>();
             if (d.contains("world_size")) s.world_size = d["world_size"].cast<int>();
             if (d.contains("local_world_size"))
               s.local_world_size = d["local_world_size"].cast<int>();
             if (d.contains("layouts")) {
               for (const auto& kv : d["layouts"].cast<py::dict>()) {
                 const py::dict l = kv.second.cast<py::dict>();
                 BucketLayout layout;
                 layout.index = l["index"].cast<int64_t>();
                 const int dtype = l["dtype"].cast<int>();
                 GRADCOMP_TORCH_CHECK(gradcomp::math::dtype_valid(static_cast<uint8_t>(dtype)),
                                      "state_dict layout has dtype code ", dtype);
                 layout.dtype = static_cast<DType>(dtype);
                 layout.params = l["params"].cast<std::vector<std::pair<int64_t, int64_t>>>();
                 s.layouts[kv.first.cast<uint64_t>()] = std::move(layout);
               }
             }
             call_core([&] { h.engine().load_state(std::move(s)); });
           })
      .def("set_parameters", &DdpHook::set_parameters, py::arg("params"));
  // GradSync for Python callers (gradcomp's tests: the C++ API under Python-only modes such as
  // compiled autograd); C++ programs use gradcomp::GradSync itself.
  py::class_<gradcomp::GradSync>(m, "GradSync")
      .def(py::init([](std::vector<at::Tensor> params, py::object group, const py::dict& options) {
             auto pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             gradcomp::GradSyncOptions o;
             if (options.contains("worker_cpus"))
               o.worker_cpus = options["worker_cpus"].cast<std::string>();
             const gradcomp::CodecSpec codec = parse_codec(options);
             py::gil_scoped_release release;  // the constructor broadcasts over the group
             return call_core(
                 [&] { return std::make_unique<gradcomp::GradSync>(params, pg, codec, o); });
           }),
           py::arg("parameters"), py::arg("process_group"), py::arg("options"))
      .def("finish",
           [](gradcomp::GradSync& s) {
             py::gil_scoped_release release;
             call_core([&] { s.finish(); });
           })
      .def("metrics_text", &gradcomp::GradSync::metrics_text)
      .def("write_metrics", &gradcomp::GradSync::write_metrics, py::arg("path"))
      .def("stats", [](const gradcomp::GradSync& s) {
        const gradcomp::GradSyncStats st = s.stats();
        py::dict d;
        d["step"] = stats_dict(st.step);
        d["total"] = stats_dict(st.total);
        return d;
      });
  // DiLoCo (gradcomp/diloco.py wraps it around a model and its optimizer).
  py::class_<gradcomp::DiLoCo>(m, "DiLoCo")
      .def(py::init([](std::vector<at::Tensor> params, py::object group, const py::dict& options) {
             auto pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             gradcomp::DiLoCoOptions o;
             o.outer.inner_steps = options["inner_steps"].cast<uint32_t>();
             o.outer.outer_lr = options["outer_lr"].cast<float>();
             o.outer.outer_momentum = options["outer_momentum"].cast<float>();
             o.outer.nesterov = options["nesterov"].cast<bool>();
             o.outer.fragments = options["fragments"].cast<uint32_t>();
             o.outer.overlap_steps = options["overlap_steps"].cast<uint32_t>();
             o.outer.mixing = options["mixing"].cast<float>();
             o.outer.eager = options["eager"].cast<bool>();
             o.warn_short_run = false;  // diloco.py warned, knowing which settings were passed
             o.collective_timeout = parse_timeout(options);
             if (!options["intra_node"].is_none()) {
               o.node_groups.intra_node =
                   options["intra_node"].cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
               o.node_groups.inter_node =
                   options["inter_node"].cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             }
             const gradcomp::CodecSpec codec = parse_codec(options);
             py::gil_scoped_release release;  // the constructor broadcasts over the group
             return call_core(
                 [&] { return std::make_unique<gradcomp::DiLoCo>(params, pg, codec, o); });
           }),
           py::arg("parameters"), py::arg("process_group"), py::arg("options"))
      .def("step",
           [](gradcomp::DiLoCo& d) {
             py::gil_scoped_release release;
             return call_core([&] { return d.step(); });
           })
      .def("flush",
           [](gradcomp::DiLoCo& d) {
             py::gil_scoped_release release;
             return call_core([&] { return d.flush(); });
           })
      .def("fragments", &gradcomp::DiLoCo::fragments)
      .def("metrics_text", &gradcomp::DiLoCo::metrics_text)
      .def("stats",
           [](const gradcomp::DiLoCo& d) {
             const gradcomp::OuterSyncStats s = d.stats();
             py::dict out;
             out["inner_steps"] = s.inner_steps;
             out["rounds"] = s.rounds;
             out["nonfinite_rounds"] = s.nonfinite_rounds;
             out["bytes_sent"] = s.bytes_sent;
             out["uncompressed_bytes"] = s.uncompressed_bytes;
             out["ratio"] =
                 s.bytes_sent > 0 ? static_cast<double>(s.uncompressed_bytes) / s.bytes_sent : 0.0;
             out["seconds"] = s.seconds;
             out["wait_seconds"] = s.wait_seconds;
             out["background_seconds"] = s.background_seconds;
             return out;
           })
      .def("state_dict",
           [](const gradcomp::DiLoCo& d) {
             gradcomp::OuterSyncState state;
             {
               // With a round in flight, state() waits for its allreduce.
               py::gil_scoped_release release;
               state = call_core([&] { return d.state(); });
             }
             py::dict out;
             for (const auto& kv : outer_state_tensors(state, d.world_size()))
               out[py::str(kv.first)] = kv.second;
             return out;
           })
      .def("load_state_dict", [](gradcomp::DiLoCo& d, const py::dict& state) {
        const gradcomp::OuterSyncState s = call_core([&] {
          return outer_state_from_tensors(
              [&](const std::string& name) {
                GRADCOMP_CHECK(state.contains(name), "DiLoCo state_dict has no '" << name << "'");
                const py::object value = state[py::str(name)];
                GRADCOMP_CHECK(THPVariable_Check(value.ptr()),
                               "DiLoCo state_dict['"
                                   << name << "'] is a "
                                   << py::type::of(value).attr("__name__").cast<std::string>()
                                   << ", not a tensor");
                return value.cast<at::Tensor>();
              },
              d.world_size());
        });
        call_core([&] { d.load_state(s); });
      });
  // FSDP2's custom reduce-scatter and HSDP's all-reduce hook (gradcomp/fsdp.py adapts FSDP's
  // interfaces to them).
  py::class_<FsdpCollective, std::shared_ptr<FsdpCollective>>(m, "FsdpCollective")
      .def("world_size", &FsdpCollective::world_size)
      .def("last_step_stats", [](const FsdpCollective& c) { return stats_dict(c.step_stats()); })
      .def("total_stats", [](const FsdpCollective& c) { return stats_dict(c.total_stats()); })
      .def("flush", &FsdpCollective::flush, py::call_guard<py::gil_scoped_release>())
      .def("state_dict",
           [](const FsdpCollective& c) {
             const gradcomp::CompressionState s = c.state();
             py::dict d;
             d["format"] = 1;
             d["seed"] = s.seed;
             d["step"] = s.step;
             d["world_size"] = c.world_size();
             d["residuals"] = residual_dict(s.residuals);
             d["chunk_residuals"] = residual_dict(s.chunk_residuals);
             return d;
           })
      .def("load_state_dict", [](FsdpCollective& c, const py::dict& d) {
        GRADCOMP_TORCH_CHECK(d.contains("format") && d["format"].cast<int>() == 1,
                             "not a gradcomp FSDP collective state (format 1)");
        gradcomp::CompressionState s;
        s.residuals = residual_map(d["residuals"].cast<py::dict>());
        s.chunk_residuals = residual_map(d["chunk_residuals"].cast<py::dict>());
        const int saved = d["world_size"].cast<int>();
        // A state without residuals (saved before any step, or reset) fits any group.
        GRADCOMP_TORCH_CHECK(
            (s.residuals.empty() && s.chunk_residuals.empty()) || saved == c.world_size(),
            "the state was saved by a group of ", saved, " ranks and this group has ",
            c.world_size(),
            ": each rank's residuals are laid out for the group's size and cannot be regrouped "
            "(load_state_dict(state, reset_residuals=True) drops them)");
        s.seed = d["seed"].cast<uint64_t>();
        s.step = d["step"].cast<uint32_t>();
        c.load_state(s);
      });
  py::class_<FsdpReduceScatter, FsdpCollective, std::shared_ptr<FsdpReduceScatter>>(
      m, "FsdpReduceScatter")
      .def(py::init(&make_fsdp_collective<FsdpReduceScatter>), py::arg("process_group"),
           py::arg("options"))
      .def(
          "reduce_scatter",
          [](FsdpReduceScatter& rs, const at::Tensor& output, const at::Tensor& input,
             uint64_t bucket, double divisor) {
            py::gil_scoped_release release;
            return rs.reduce_scatter(output, input, bucket, divisor);
          },
          py::arg("output"), py::arg("input"), py::arg("bucket"), py::arg("divisor"));
  py::class_<FsdpReplicaAllreduce, FsdpCollective, std::shared_ptr<FsdpReplicaAllreduce>>(
      m, "FsdpReplicaAllreduce")
      .def(py::init(&make_fsdp_collective<FsdpReplicaAllreduce>), py::arg("process_group"),
           py::arg("options"))
      .def(
          "allreduce",
          [](FsdpReplicaAllreduce& ar, const at::Tensor& tensor, uint64_t bucket) {
            py::gil_scoped_release release;
            return ar.allreduce(tensor, bucket);
          },
          py::arg("tensor"), py::arg("bucket"));
  bind_all_gathers(m);  // after FsdpCollective, their base
  m.def(
      "fsdp_metrics_text",
      [](const std::vector<std::shared_ptr<FsdpCollective>>& collectives, int rank,
         const std::string& codec, bool weights) {
        // The gradients' collectives in the gradcomp_* series, the parameter all-gathers in
        // gradcomp_weight_* (with `weights`, zero until the first); steps are the training's,
        // which every collective counts alike.
        gradcomp::ReductionStats gradients, gathers;
        uint64_t steps = 0;
        for (const auto& c : collectives) {
          const gradcomp::ReductionStats s = c->total_stats();
          (dynamic_cast<const FsdpAllGather*>(c.get()) != nullptr ? gathers : gradients).add(s);
          steps = std::max(steps, s.steps);
        }
        gradients.steps = steps;
        const auto labels = gradcomp::metric_labels(rank, codec, "fsdp");
        return weights ? gradcomp::prometheus_text(gradients, gathers, labels)
                       : gradcomp::prometheus_text(gradients, labels);
      },
      py::arg("collectives"), py::arg("rank"), py::arg("codec"), py::arg("weights") = false);
  // A front end's counters before it has anything to count (a HookState not yet bound to its
  // process group): the same names and labels, every value zero, with no hook to read.
  m.def(
      "zero_metrics_text",
      [](int rank, const std::string& codec, const std::string& front_end) {
        return gradcomp::prometheus_text(gradcomp::ReductionStats{},
                                         gradcomp::metric_labels(rank, codec, front_end));
      },
      py::arg("rank"), py::arg("codec"), py::arg("front_end"));
  m.def(
      "premul_sum_factor",
      [](const py::object& op) { return compat::premul_sum_factor(op.cast<c10d::ReduceOp>()); },
      py::arg("op"));
  // DiLoCo's short-run warning: the core's rule and numbers (gradcomp/outer_short_run.h).
  m.def(
      "diloco_short_run_warning",
      [](bool defaults_kept, uint32_t inner_steps, uint64_t planned_steps) {
        return call_core(
            [&] { return gradcomp::short_run_warning(defaults_kept, inner_steps, planned_steps); });
      },
      py::arg("defaults_kept"), py::arg("inner_steps"), py::arg("planned_steps"));
  m.attr("diloco_short_run_measurements") = gradcomp::short_run_measurements();
  m.attr("diloco_short_run_rounds") = gradcomp::kShortRunRounds;
  m.def("adaptive_optimizer_warning", [](const py::dict& options) {
    return gradcomp::adaptive_optimizer_warning(parse_codec(options));
  });
  m.def("launch_env", [] {
    const gradcomp::LaunchEnv e = call_core([] { return gradcomp::launch_env(); });
    py::dict d;
    d["rank"] = e.rank;
    d["world_size"] = e.world_size;
    d["local_rank"] = e.local_rank;
    d["local_world_size"] = e.local_world_size;
    d["master_addr"] = e.master_addr;
    d["master_port"] = e.master_port;
    d["launcher"] = e.launcher;
    return d;
  });
  m.def(
      "install_hook",
      [](py::object reducer, std::shared_ptr<DdpHook> hook) {
        std::shared_ptr<c10d::Reducer> r;
        try {
          r = reducer.cast<std::shared_ptr<c10d::Reducer>>();
        } catch (const py::cast_error&) {
          GRADCOMP_TORCH_CHECK(
              false,
              "ddp_model.reducer is not a c10d Reducer this extension can use; was gradcomp "
              "built against the installed torch?");
        }
        r->register_comm_hook(std::make_unique<GradcompCommHook>(std::move(hook)));
      },
      py::arg("reducer"), py::arg("hook"));
  m.def("bucket_identity", [](int64_t index, const at::Tensor& buffer,
                              const std::vector<std::vector<int64_t>>& shapes) {
    return ddp_bucket_identity(index, buffer, shapes);
  });
  std::vector<int> block_sizes;  // from the one rule, so Python's checks cannot drift from it
  for (uint32_t b = 1; b <= gradcomp::math::kQ4MaxBlock; ++b)
    if (gradcomp::math::q4_block_size_valid(b)) block_sizes.push_back(static_cast<int>(b));
  m.attr("q4_block_sizes") = py::tuple(py::cast(block_sizes));
  m.attr("q4_default_piece_numel") = gradcomp::CompressionConfig::kDefaultPieceNumel;
  m.attr("built_for_torch") = GRADCOMP_BUILT_FOR_TORCH;
  m.attr("with_cuda") =
#if defined(GRADCOMP_HAVE_CUDA)
      true;
#else
      false;
#endif
}
