// gradcomp::WeightAllGather: FSDP's weight all-gather (FsdpAllGather, int8 or 4-bit rows) for C++
// programs that shard their own parameters, on the CPU or on CUDA.
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "fsdp_collectives.h"
#include "gradcomp/torch.h"
#include "tensor_params.h"

namespace gradcomp {

// The FSDP front end's collective, one run of the input's dtype per row: the same binding to the
// device and stream, the same checks and counters; its errors name this class.
struct WeightAllGather::Impl {
  Impl(c10::intrusive_ptr<c10d::ProcessGroup> group, const AllGatherOptions& options,
       std::chrono::milliseconds timeout)
      : gather(std::move(group), options, timeout, "WeightAllGather") {}

  // A bucket per name, numbered in the order of first use: the core agrees on a bucket's layout
  // across ranks at its first call, so each name's shards are checked once, in their own size.
  uint64_t bucket_of(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu);
    return buckets.emplace(name, buckets.size()).first->second;
  }

  torch_ext::FsdpAllGather gather;
  std::mutex mu;
  std::unordered_map<std::string, uint64_t> buckets;
};

WeightAllGather::WeightAllGather(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                 AllGatherOptions options, std::chrono::milliseconds timeout) {
  GRADCOMP_TORCH_CHECK(group, "WeightAllGather without a process group");
  impl_ = std::make_unique<Impl>(std::move(group), options, timeout);
}

WeightAllGather::~WeightAllGather() = default;

void WeightAllGather::all_gather(const at::Tensor& output, const at::Tensor& input,
                                 const std::string& name) {
  const std::string input_of = "WeightAllGather input of " + name;
  torch_ext::check_gradient_tensor(input, input_of.c_str());
  torch_ext::check_gradient_tensor(output, ("WeightAllGather output of " + name).c_str());
  const AllGatherRun run{torch_ext::to_dtype(input.scalar_type(), input_of.c_str()), input.numel()};
  impl_->gather.all_gather(output, input, {run}, impl_->bucket_of(name), name,
                           /*backward=*/false);
}

uint64_t WeightAllGather::bytes_sent() const {
  return impl_->gather.total_stats().bytes_sent;
}

double WeightAllGather::codec_seconds() const {
  return impl_->gather.total_stats().codec_seconds;
}

}  // namespace gradcomp
