// gradcomp._C: Python bindings for the hook core and the C++ hook install on DDP's reducer.
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <cstring>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "comm_hook.h"
#include "tensor_params.h"

namespace py = pybind11;

namespace gradcomp {
namespace torch_ext {
namespace {

DType parse_dtype(const std::string& name, const char* what) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  GRADCOMP_TORCH_CHECK(false, what, " must be 'float32', 'float16' or 'bfloat16', got '", name,
                       "'");
}

HookOptions parse_options(const py::dict& d) {
  HookOptions o;
  const std::string codec = d["codec"].cast<std::string>();
  o.compress = codec != "none";
  CompressionConfig& c = o.config;
  c.codec = codec == "topk" ? Codec::kTopK : Codec::kQ4;
  c.seed = d["seed"].cast<uint64_t>();
  c.error_feedback = d["error_feedback"].cast<bool>();
  c.residual_dtype = parse_dtype(d["residual_dtype"].cast<std::string>(), "residual_dtype");
  if (codec == "q4") {
    c.q4.block_size = d["block_size"].cast<int>();
    c.q4.rounding =
        d["rounding"].cast<std::string>() == "nearest" ? Rounding::kNearest : Rounding::kStochastic;
    c.q4_algorithm = d["algorithm"].cast<std::string>() == "one_phase" ? Q4Algorithm::kOnePhase
                                                                       : Q4Algorithm::kTwoPhase;
  } else if (codec == "topk") {
    c.topk.ratio = d["ratio"].cast<double>();
    c.topk.exact = d["exact"].cast<bool>();
    c.topk.value_dtype = parse_dtype(d["value_dtype"].cast<std::string>(), "value_dtype");
  }
  call_core([&] { c.validate(); });
  return o;
}

py::dict stats_dict(const HookStats& s) {
  py::dict d;
  d["buckets"] = s.buckets;
  d["bytes_sent"] = s.bytes_sent;
  d["uncompressed_bytes"] = s.uncompressed_bytes;
  d["ratio"] = s.bytes_sent > 0 ? static_cast<double>(s.uncompressed_bytes) / s.bytes_sent : 0.0;
  d["codec_seconds"] = s.codec_seconds;
  d["comm_seconds"] = s.comm_seconds;
  d["nonfinite_buckets"] = s.nonfinite_buckets;
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

}  // namespace
}  // namespace torch_ext
}  // namespace gradcomp

PYBIND11_MODULE(_C, m) {
  using namespace gradcomp::torch_ext;
  m.doc() = "gradcomp C++ extension: compressed DDP communication hook and codec ops";
  py::class_<HookCore, std::shared_ptr<HookCore>>(m, "HookCore")
      .def(py::init([](py::object group, const py::dict& options) {
             auto pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             return std::make_shared<HookCore>(pg, parse_options(options));
           }),
           py::arg("process_group"), py::arg("options"))
      .def(
          "reduce_bucket",
          [](HookCore& core, at::Tensor bucket, int64_t index,
             const std::vector<std::vector<int64_t>>& shapes, bool is_last) {
            const uint64_t id =
                bucket_identity(index, bucket.numel(), bucket.scalar_type(), shapes);
            py::gil_scoped_release release;
            core.reduce(bucket, index, id, is_last);
            return bucket;
          },
          py::arg("bucket"), py::arg("index"), py::arg("param_shapes"), py::arg("is_last") = false)
      .def("last_step_stats", [](const HookCore& c) { return stats_dict(c.last_step_stats()); })
      .def("total_stats", [](const HookCore& c) { return stats_dict(c.total_stats()); })
      .def("world_size", &HookCore::world_size)
      .def("state_dict",
           [](const HookCore& c) {
             gradcomp::CompressionState s = c.state();
             py::dict d;
             d["format"] = 1;
             d["seed"] = s.seed;
             d["step"] = s.step;
             d["started"] = c.started();
             d["residuals"] = residual_dict(s.residuals);
             d["chunk_residuals"] = residual_dict(s.chunk_residuals);
             py::dict layouts;
             for (const auto& [id, layout] : c.layouts()) {
               if (s.residuals.count(id) == 0) continue;
               py::dict l;
               l["index"] = layout.index;
               l["dtype"] = layout.dtype;
               l["params"] = layout.params;
               layouts[py::int_(id)] = l;
             }
             d["layouts"] = layouts;
             return d;
           })
      .def("load_state_dict",
           [](HookCore& c, const py::dict& d) {
             GRADCOMP_TORCH_CHECK(d.contains("format") && d["format"].cast<int>() == 1,
                                  "not a gradcomp hook state_dict (format 1)");
             gradcomp::CompressionState s;
             s.seed = d["seed"].cast<uint64_t>();
             s.step = d["step"].cast<uint32_t>();
             s.residuals = residual_map(d["residuals"].cast<py::dict>());
             s.chunk_residuals = residual_map(d["chunk_residuals"].cast<py::dict>());
             std::map<uint64_t, HookCore::BucketLayout> layouts;
             if (d.contains("layouts")) {
               for (const auto& kv : d["layouts"].cast<py::dict>()) {
                 const py::dict l = kv.second.cast<py::dict>();
                 HookCore::BucketLayout layout;
                 layout.index = l["index"].cast<int64_t>();
                 layout.dtype = l["dtype"].cast<int>();
                 layout.params = l["params"].cast<std::vector<std::pair<int64_t, int64_t>>>();
                 layouts[kv.first.cast<uint64_t>()] = std::move(layout);
               }
             }
             c.load_state(s, d["started"].cast<bool>(), std::move(layouts));
           })
      .def("set_parameters", &HookCore::set_parameters, py::arg("params"));
  m.def(
      "install_hook",
      [](py::object reducer, std::shared_ptr<HookCore> core) {
        std::shared_ptr<c10d::Reducer> r;
        try {
          r = reducer.cast<std::shared_ptr<c10d::Reducer>>();
        } catch (const py::cast_error&) {
          GRADCOMP_TORCH_CHECK(
              false,
              "ddp_model.reducer is not a c10d Reducer this extension can use; was gradcomp "
              "built against the installed torch?");
        }
        r->register_comm_hook(std::make_unique<GradcompCommHook>(std::move(core)));
      },
      py::arg("reducer"), py::arg("core"));
  m.def("bucket_identity", [](int64_t index, const at::Tensor& buffer,
                              const std::vector<std::vector<int64_t>>& shapes) {
    return bucket_identity(index, buffer.numel(), buffer.scalar_type(), shapes);
  });
  m.attr("with_cuda") =
#if defined(GRADCOMP_HAVE_CUDA)
      true;
#else
      false;
#endif
}
