// What gradcomp._C's binding files share: module.cpp's option parsers, and the binders kept in
// files of their own so that each file stays short.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "gradcomp/codec_spec.h"
#include "gradcomp/engine.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace torch_ext {

// "float32", "float16" or "bfloat16"; an error naming `what` otherwise.
DType parse_dtype(const std::string& name, const char* what);
// The option dict's "timeout" in seconds (absent or None: the process group's).
std::chrono::milliseconds parse_timeout(const pybind11::dict& d);
// A Python codec spec's options (gradcomp.Q4 / TopK / Q2 / NoCompression ._options()).
CodecSpec parse_codec(const pybind11::dict& d);
// A front end's stats() dict.
pybind11::dict stats_dict(const ReductionStats& s);
// Residuals by bucket as uint8 tensors (state_dict) and back (load_state_dict).
pybind11::dict residual_dict(const std::map<uint64_t, std::vector<uint8_t>>& m);
std::map<uint64_t, std::vector<uint8_t>> residual_map(const pybind11::dict& d);

// Binds FsdpCollective, FsdpReduceScatter, FsdpReplicaAllreduce, the all-gathers and
// fsdp_metrics_text (fsdp_bindings.cpp).
void bind_fsdp_collectives(pybind11::module_& m);

// Binds FsdpAllGather and WeightAllGather (all_gather_bindings.cpp); FsdpCollective must be bound
// first (their base).
void bind_all_gathers(pybind11::module_& m);

}  // namespace torch_ext
}  // namespace gradcomp
