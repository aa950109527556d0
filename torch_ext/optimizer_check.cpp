// The optimizer contract of a codec spec: momentum correction needs SGD without momentum, and
// top-k with an adaptive optimizer is warned about.
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "gradcomp/torch.h"

namespace gradcomp {

void check_optimizer(const torch::optim::Optimizer& optimizer, const CodecSpec& codec) {
  const bool adaptive = dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
                        dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr ||
                        dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr ||
                        dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr;
  const std::string advice = adaptive_optimizer_warning(codec);
  if (adaptive && !advice.empty()) TORCH_WARN("gradcomp: ", advice);
  const TopK* topk = std::get_if<TopK>(&codec);
  if (topk == nullptr || topk->momentum == 0.0f) return;
  const auto* sgd = dynamic_cast<const torch::optim::SGD*>(&optimizer);
  GRADCOMP_CHECK(sgd != nullptr, "TopK momentum " << topk->momentum
                                                  << " applies momentum itself (DGC's momentum "
                                                     "correction): the optimizer must be "
                                                     "torch::optim::SGD with momentum 0");
  const auto& groups = sgd->param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(groups[i].options());
    GRADCOMP_CHECK(o.momentum() == 0.0 && !o.nesterov(),
                   "TopK momentum " << topk->momentum << ": optimizer param group " << i
                                    << " has momentum " << o.momentum()
                                    << (o.nesterov() ? " with Nesterov" : "")
                                    << "; set it to 0 (the velocity of GradSync replaces it)");
  }
}

}  // namespace gradcomp
