// A DiLoCo state as named tensors, the one form both front ends checkpoint (a torch archive in
// C++, a state_dict in Python).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>

#include "gradcomp/outer_sync.h"

namespace gradcomp {
namespace torch_ext {

std::map<std::string, at::Tensor> outer_state_tensors(const OuterSyncState& state, int world_size);
// `get` returns the tensor saved under a name (or raises when it is missing). Checks every
// tensor's dtype and shape, and that the residuals were saved by a group of `world_size`.
OuterSyncState outer_state_from_tensors(const std::function<at::Tensor(const std::string&)>& get,
                                        int world_size);

}  // namespace torch_ext
}  // namespace gradcomp
