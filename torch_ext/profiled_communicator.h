// A Communicator that names each collective as a profiler phase, for transports that do not
// (the shared-memory one), so that timelines show every collective of a bucket.
#pragma once

#include <memory>
#include <utility>

#include "gradcomp/communicator.h"
#include "profiler_ranges.h"

namespace gradcomp {
namespace torch_ext {

class ProfiledCommunicator final : public Communicator {
 public:
  explicit ProfiledCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  bool device_memory() const override { return inner_->device_memory(); }

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes_per_rank) override {
    GRADCOMP_PHASE("gradcomp::all_to_all");
    inner_->all_to_all(send, recv, bytes_per_rank);
  }
  void run_all_gather(const void* send, void* recv, size_t bytes_per_rank) override {
    GRADCOMP_PHASE("gradcomp::all_gather");
    inner_->all_gather(send, recv, bytes_per_rank);
  }
  void run_allreduce_mean(void* data, int64_t numel, DType dtype) override {
    GRADCOMP_PHASE("gradcomp::allreduce");
    inner_->allreduce_mean(data, numel, dtype);
  }
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                               DType dtype) override {
    GRADCOMP_PHASE("gradcomp::reduce_scatter");
    inner_->reduce_scatter_mean(send, recv, numel_per_rank, dtype);
  }
  void run_reduce_scatter_mean_strided(const void* send, int64_t send_stride, void* recv,
                                       int64_t numel_per_rank, DType dtype) override {
    GRADCOMP_PHASE("gradcomp::reduce_scatter");
    inner_->reduce_scatter_mean_strided(send, send_stride, recv, numel_per_rank, dtype);
  }
  void run_all_gather_strided(const void* send, void* recv, size_t bytes_per_rank,
                              size_t recv_stride) override {
    GRADCOMP_PHASE("gradcomp::all_gather");
    inner_->all_gather_strided(send, recv, bytes_per_rank, recv_stride);
  }

 private:
  std::unique_ptr<Communicator> inner_;
};

}  // namespace torch_ext
}  // namespace gradcomp
