// What the front ends that own their parameters (GradSync, DiLoCo) agree on before the first step.
#pragma once

#include <ATen/ATen.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace gradcomp {
namespace torch_ext {

// Raises gradcomp::Error, as `who`, when some rank's parameters differ in count, total size or
// any shape or dtype from rank 0's.
void check_same_model_on_every_rank(const std::vector<at::Tensor>& params,
                                    c10d::ProcessGroup& group, at::Device device, const char* who);
// Copies rank 0's parameter values to every rank.
void broadcast_parameters(const std::vector<at::Tensor>& params, c10d::ProcessGroup& group);

}  // namespace torch_ext
}  // namespace gradcomp
