// What gradcomp._C's binding files share: module.cpp's option parsers, and the binders kept in
// files of their own so that each file stays short.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <string>

#include "gradcomp/types.h"

namespace gradcomp {
namespace torch_ext {

// "float32", "float16" or "bfloat16"; an error naming `what` otherwise.
DType parse_dtype(const std::string& name, const char* what);
// The option dict's "timeout" in seconds (absent or None: the process group's).
std::chrono::milliseconds parse_timeout(const pybind11::dict& d);

// Binds FsdpAllGather and Int8AllGather (all_gather_bindings.cpp); FsdpCollective must be bound
// first (their base).
void bind_all_gathers(pybind11::module_& m);

}  // namespace torch_ext
}  // namespace gradcomp
