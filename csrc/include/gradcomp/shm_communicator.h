// Ranks of one host exchanging through a POSIX shared-memory segment: the CPU's intra-node
// transport for hierarchical reductions (what NVLink is to GPUs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "gradcomp/communicator.h"

namespace gradcomp {

// Every rank of the group constructs one with the same `name` (a job-unique POSIX shm name,
// "/..."): rank 0 creates the segment, the others attach to it, and rank 0 unlinks the name once
// all have, so nothing outlives the processes. Collectives move data through one slot of
// `slot_bytes` per rank, in pieces when larger; a sum is x / W added in rank order in fp32, as
// the in-process transport does. A rank that waits longer than `timeout_seconds` for its peers
// raises an Error naming how many arrived, and marks the group failed so the others raise too.
class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(const std::string& name, int rank, int world, double timeout_seconds = 60.0,
                  size_t slot_bytes = size_t{8} << 20);
  ~ShmCommunicator() override;
  ShmCommunicator(const ShmCommunicator&) = delete;
  ShmCommunicator& operator=(const ShmCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  bool device_memory() const override { return false; }

  struct Header;

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes_per_rank) override;
  void run_all_gather(const void* send, void* recv, size_t bytes_per_rank) override;
  void run_allreduce_mean(void* data, int64_t numel, DType dtype) override;
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                               DType dtype) override;
  void run_reduce_scatter_mean_strided(const void* send, int64_t send_stride, void* recv,
                                       int64_t numel_per_rank, DType dtype) override;
  void run_all_gather_strided(const void* send, void* recv, size_t bytes_per_rank,
                              size_t recv_stride) override;

 private:
  void barrier(const char* what);
  uint8_t* slot(int rank) const;
  // recv[i] = mean over ranks of element i of each slot's piece `piece` (of `numel` elements).
  void mean_of_slots(size_t piece_offset, int64_t numel, DType dtype, void* out) const;

  std::string name_;
  int rank_, world_;
  double timeout_s_;
  size_t slot_bytes_, mapped_bytes_ = 0;
  Header* header_ = nullptr;
};

}  // namespace gradcomp
