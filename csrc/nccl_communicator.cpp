// NCCL implementation of the collective interface: grouped send/recv for all-to-all, allgather.
#include "gradcomp/nccl_communicator.h"

namespace gradcomp {

NcclCommunicator::NcclCommunicator(ncclComm_t comm, cudaStream_t stream)
    : comm_(comm), stream_(stream) {
  GRADCOMP_CHECK(comm != nullptr, "NcclCommunicator: null communicator");
  GRADCOMP_NCCL_CHECK(ncclCommUserRank(comm, &rank_));
  GRADCOMP_NCCL_CHECK(ncclCommCount(comm, &world_));
}

void NcclCommunicator::all_to_all(const void* send, void* recv, size_t bytes) {
  const char* s = static_cast<const char*>(send);
  char* r = static_cast<char*>(recv);
  GRADCOMP_NCCL_CHECK(ncclGroupStart());
  for (int peer = 0; peer < world_; ++peer) {
    GRADCOMP_NCCL_CHECK(ncclSend(s + bytes * peer, bytes, ncclUint8, peer, comm_, stream_));
    GRADCOMP_NCCL_CHECK(ncclRecv(r + bytes * peer, bytes, ncclUint8, peer, comm_, stream_));
  }
  GRADCOMP_NCCL_CHECK(ncclGroupEnd());
  bytes_sent_ += bytes * static_cast<uint64_t>(world_ - 1);
}

void NcclCommunicator::all_gather(const void* send, void* recv, size_t bytes) {
  GRADCOMP_NCCL_CHECK(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_));
  bytes_sent_ += bytes * static_cast<uint64_t>(world_ - 1);
}

}  // namespace gradcomp
