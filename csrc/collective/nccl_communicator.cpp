// NCCL transport: grouped send/recv for all-to-all, allgather, and an averaging allreduce.
#include "gradcomp/nccl_communicator.h"

namespace gradcomp {

NcclCommunicator::NcclCommunicator(ncclComm_t comm, cudaStream_t stream)
    : comm_(comm), stream_(stream) {
  GRADCOMP_CHECK(comm != nullptr, "NcclCommunicator: null communicator");
  GRADCOMP_NCCL_CHECK(ncclCommUserRank(comm, &rank_));
  GRADCOMP_NCCL_CHECK(ncclCommCount(comm, &world_));
}

void NcclCommunicator::run_all_to_all(const void* send, void* recv, size_t bytes) {
  const char* s = static_cast<const char*>(send);
  char* r = static_cast<char*>(recv);
  GRADCOMP_NCCL_CHECK(ncclGroupStart());
  for (int peer = 0; peer < world_; ++peer) {
    GRADCOMP_NCCL_CHECK(ncclSend(s + bytes * peer, bytes, ncclUint8, peer, comm_, stream_));
    GRADCOMP_NCCL_CHECK(ncclRecv(r + bytes * peer, bytes, ncclUint8, peer, comm_, stream_));
  }
  GRADCOMP_NCCL_CHECK(ncclGroupEnd());
}

void NcclCommunicator::run_all_gather(const void* send, void* recv, size_t bytes) {
  GRADCOMP_NCCL_CHECK(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_));
}

namespace {

ncclDataType_t nccl_type(DType dtype) {
  return dtype == DType::kFloat32 ? ncclFloat32
                                  : (dtype == DType::kFloat16 ? ncclFloat16 : ncclBfloat16);
}

}  // namespace

void NcclCommunicator::run_allreduce_mean(void* data, int64_t numel, DType dtype) {
  const ncclDataType_t type = nccl_type(dtype);
  GRADCOMP_NCCL_CHECK(
      ncclAllReduce(data, data, static_cast<size_t>(numel), type, ncclAvg, comm_, stream_));
}

void NcclCommunicator::run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                                               DType dtype) {
  GRADCOMP_NCCL_CHECK(ncclReduceScatter(send, recv, static_cast<size_t>(numel_per_rank),
                                        nccl_type(dtype), ncclAvg, comm_, stream_));
}

}  // namespace gradcomp
