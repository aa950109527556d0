// Parameter agreement across ranks: the same model everywhere, rank 0's values everywhere.
#include "parameter_agreement.h"

#include "gradcomp/types.h"

namespace gradcomp {
namespace torch_ext {

void check_same_model_on_every_rank(const std::vector<at::Tensor>& params,
                                    c10d::ProcessGroup& group, at::Device device, const char* who) {
  // Parameter count, total size and a hash of every shape and dtype, gathered from every rank.
  uint64_t h = 1469598103934665603ull;
  int64_t total = 0;
  auto mix = [&](uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
  };
  for (const at::Tensor& p : params) {
    mix(static_cast<uint64_t>(p.scalar_type()));
    mix(static_cast<uint64_t>(p.dim()));
    for (int64_t d : p.sizes()) mix(static_cast<uint64_t>(d));
    total += p.numel();
  }
  const int world = group.getSize();
  at::Tensor mine = at::tensor({static_cast<int64_t>(params.size()), total,
                                static_cast<int64_t>(h & 0x7FFFFFFFFFFFFFFFull)},
                               at::TensorOptions().dtype(at::kLong))
                        .to(device);
  std::vector<std::vector<at::Tensor>> all(1);
  for (int w = 0; w < world; ++w) all[0].push_back(at::empty_like(mine));
  std::vector<at::Tensor> in = {mine};
  group.allgather(all, in)->wait();
  const at::Tensor ref = all[0][0].cpu();
  for (int w = 1; w < world; ++w) {
    const at::Tensor other = all[0][w].cpu();
    if (at::equal(other, ref)) continue;
    GRADCOMP_CHECK(false, who << ": rank " << w << " has " << other[0].item<int64_t>()
                              << " parameters of " << other[1].item<int64_t>()
                              << " elements, rank 0 has " << ref[0].item<int64_t>() << " of "
                              << ref[1].item<int64_t>()
                              << (other[0].item<int64_t>() == ref[0].item<int64_t>()
                                      ? " (shapes or dtypes differ)"
                                      : "")
                              << "; every rank must build the same model");
  }
}

void broadcast_parameters(const std::vector<at::Tensor>& params, c10d::ProcessGroup& group) {
  at::NoGradGuard no_grad;
  for (const at::Tensor& p : params) {
    std::vector<at::Tensor> t = {p.detach()};
    group.broadcast(t)->wait();
  }
}

}  // namespace torch_ext
}  // namespace gradcomp
