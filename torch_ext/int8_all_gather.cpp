// gradcomp::Int8AllGather: FSDP's int8 all-gather (FsdpAllGather) for C++ programs that shard
// their own parameters, on the CPU or on CUDA.
#include <utility>

#include "fsdp_collectives.h"
#include "gradcomp/torch.h"
#include "tensor_params.h"

namespace gradcomp {

// The FSDP front end's collective, one run of the input's dtype per row: the same binding to the
// device and stream, the same checks and counters.
struct Int8AllGather::Impl {
  Impl(c10::intrusive_ptr<c10d::ProcessGroup> group, const Int8Options& options,
       std::chrono::milliseconds timeout)
      : gather(std::move(group), options, timeout) {}
  torch_ext::FsdpAllGather gather;
};

Int8AllGather::Int8AllGather(c10::intrusive_ptr<c10d::ProcessGroup> group, Int8Options options,
                             std::chrono::milliseconds timeout) {
  GRADCOMP_TORCH_CHECK(group, "Int8AllGather without a process group");
  impl_ = std::make_unique<Impl>(std::move(group), options, timeout);
}

Int8AllGather::~Int8AllGather() = default;

void Int8AllGather::all_gather(const at::Tensor& output, const at::Tensor& input,
                               const std::string& name) {
  torch_ext::check_gradient_tensor(input, "Int8AllGather input");
  torch_ext::check_gradient_tensor(output, "Int8AllGather output");
  const AllGatherRun run{torch_ext::to_dtype(input.scalar_type(), "Int8AllGather input"),
                         input.numel()};
  impl_->gather.all_gather(output, input, {run}, /*bucket_id=*/0, name, /*backward=*/false);
}

uint64_t Int8AllGather::bytes_sent() const {
  return impl_->gather.total_stats().bytes_sent;
}

double Int8AllGather::codec_seconds() const {
  return impl_->gather.total_stats().codec_seconds;
}

}  // namespace gradcomp
