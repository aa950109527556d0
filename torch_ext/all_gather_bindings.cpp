// gradcomp._C's bindings of the weight all-gathers (int8, 4-bit): FSDP's (gradcomp/fsdp.py) and the
// C++ API's gradcomp::WeightAllGather (bound for its tests).
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "fsdp_collectives.h"
#include "gradcomp/torch.h"
#include "tensor_params.h"

namespace py = pybind11;

namespace gradcomp {
namespace torch_ext {

void bind_all_gathers(py::module_& m) {
  py::class_<FsdpAllGather, FsdpCollective, std::shared_ptr<FsdpAllGather>>(m, "FsdpAllGather")
      .def(py::init([](py::object group, const py::dict& options) {
             gradcomp::AllGatherOptions o;
             if (options.contains("block_size")) o.block_size = options["block_size"].cast<int>();
             if (options.contains("codec")) {
               const auto codec = options["codec"].cast<std::string>();
               GRADCOMP_CHECK(codec == "int8" || codec == "int4",
                              "the weight all-gather's codec is int8 or int4, got " << codec);
               o.codec = codec == "int4" ? WeightCodec::kInt4 : WeightCodec::kInt8;
             }
             return std::make_shared<FsdpAllGather>(
                 group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>(), o, parse_timeout(options));
           }),
           py::arg("process_group"), py::arg("options"))
      .def(
          "all_gather",
          [](FsdpAllGather& ag, const at::Tensor& output, const at::Tensor& input,
             const std::vector<std::pair<std::string, int64_t>>& runs, uint64_t bucket,
             const std::string& name, bool backward) {
            std::vector<gradcomp::AllGatherRun> layout;
            for (const auto& run : runs) {
              gradcomp::AllGatherRun r;
              r.dtype = parse_dtype(run.first, "an all-gather run's dtype");
              r.numel = run.second;
              layout.push_back(r);
            }
            py::gil_scoped_release release;
            ag.all_gather(output, input, layout, bucket, name, backward);
          },
          py::arg("output"), py::arg("input"), py::arg("runs"), py::arg("bucket"), py::arg("name"),
          py::arg("backward"));
  // The C++ API's gradcomp::WeightAllGather, bound for its tests.
  py::class_<gradcomp::WeightAllGather, std::shared_ptr<gradcomp::WeightAllGather>>(
      m, "WeightAllGather")
      .def(py::init([](py::object group, int block_size) {
             gradcomp::AllGatherOptions o;
             o.block_size = block_size;
             return std::make_shared<gradcomp::WeightAllGather>(
                 group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>(), o);
           }),
           py::arg("process_group"), py::arg("block_size") = 64)
      .def(
          "all_gather",
          [](gradcomp::WeightAllGather& ag, const at::Tensor& output, const at::Tensor& input,
             const std::string& name) {
            py::gil_scoped_release release;
            ag.all_gather(output, input, name);
          },
          py::arg("output"), py::arg("input"), py::arg("name") = "parameters")
      .def("bytes_sent", &gradcomp::WeightAllGather::bytes_sent);
}

}  // namespace torch_ext
}  // namespace gradcomp
