// gradcomp._C's bindings of the FSDP2 collectives: the custom reduce-scatter, HSDP's all-reduce
// hook and their metrics (gradcomp/fsdp.py adapts FSDP's interfaces to them).
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "bindings.h"
#include "fsdp_collectives.h"
#include "tensor_params.h"

namespace py = pybind11;

namespace gradcomp {
namespace torch_ext {
namespace {

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

}  // namespace

void bind_fsdp_collectives(py::module_& m) {
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
}

}  // namespace torch_ext
}  // namespace gradcomp
