// Raw-NCCL transport for programs without torch (target gradcomp::nccl).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include "gradcomp/communicator.h"

namespace gradcomp {

// The NCCL layer's one error-checking macro.
#define GRADCOMP_NCCL_CHECK(expr)                                                   \
  do {                                                                              \
    const ncclResult_t gradcomp_nccl_res_ = (expr);                                 \
    GRADCOMP_CHECK(gradcomp_nccl_res_ == ncclSuccess,                               \
                   #expr << " failed: " << ncclGetErrorString(gradcomp_nccl_res_)); \
  } while (0)

// A Communicator over an NCCL communicator the caller created (ncclCommInitRank). Collectives
// run on `stream`; pair it with a CUDA backend on the same stream.
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream);
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  bool device_memory() const override { return true; }

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes_per_rank) override;
  void run_all_gather(const void* send, void* recv, size_t bytes_per_rank) override;
  // ncclAvg on the communicator's stream.
  void run_allreduce_mean(void* data, int64_t numel, DType dtype) override;
  // ncclReduceScatter with ncclAvg on the communicator's stream.
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                               DType dtype) override;

 private:
  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0;
  int world_ = 1;
};

}  // namespace gradcomp
