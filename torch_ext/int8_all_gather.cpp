// gradcomp::Int8AllGather: the core's int8 all-gather over a c10d process group, for C++ programs.
#include <utility>

#include "gradcomp/torch.h"
#include "process_group_communicator.h"
#include "tensor_params.h"

namespace gradcomp {

struct Int8AllGather::Impl {
  Impl(c10::intrusive_ptr<c10d::ProcessGroup> group, const Int8Options& options,
       std::chrono::milliseconds timeout)
      : comm(std::move(group), at::Device(at::kCPU), timeout),
        backend(make_cpu_backend(1)),
        collective(comm, *backend, options) {}
  torch_ext::ProcessGroupCommunicator comm;
  std::unique_ptr<Backend> backend;
  CompressedAllGather collective;
};

Int8AllGather::Int8AllGather(c10::intrusive_ptr<c10d::ProcessGroup> group, Int8Options options,
                             std::chrono::milliseconds timeout) {
  GRADCOMP_TORCH_CHECK(group, "Int8AllGather without a process group");
  impl_ = torch_ext::call_core(
      [&] { return std::make_unique<Impl>(std::move(group), options, timeout); });
}

Int8AllGather::~Int8AllGather() = default;

void Int8AllGather::all_gather(const at::Tensor& output, const at::Tensor& input,
                               const std::string& name) {
  torch_ext::check_gradient_tensor(input, "Int8AllGather input");
  torch_ext::check_gradient_tensor(output, "Int8AllGather output");
  GRADCOMP_TORCH_CHECK(
      input.device().is_cpu() && output.device().is_cpu(), "Int8AllGather of ", name,
      " takes CPU tensors: its CUDA path has not been written or run on a GPU yet");
  GRADCOMP_TORCH_CHECK(input.scalar_type() == output.scalar_type(), "Int8AllGather input of ", name,
                       " is ", input.scalar_type(), " but its output is ", output.scalar_type());
  const int world = impl_->comm.world_size();
  GRADCOMP_TORCH_CHECK(output.numel() == input.numel() * world, "Int8AllGather output of ", name,
                       " has ", output.numel(), " elements, not ", world, " (world size) x ",
                       input.numel(), " (input)");
  const AllGatherRun run{torch_ext::to_dtype(input.scalar_type(), "Int8AllGather input"),
                         input.numel()};
  AllGatherRequest r;
  r.input = input.data_ptr();
  r.output = output.data_ptr();
  r.runs = &run;
  r.num_runs = 1;
  r.name = name;
  torch_ext::call_core([&] { impl_->collective.all_gather(r); });
}

uint64_t Int8AllGather::bytes_sent() const {
  return impl_->comm.bytes_sent();
}

double Int8AllGather::codec_seconds() const {
  return impl_->collective.codec_seconds();
}

}  // namespace gradcomp
