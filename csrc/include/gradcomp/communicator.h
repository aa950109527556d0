// The transport the collectives are written against: all-to-all, allgather, a plain allreduce.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "gradcomp/types.h"

namespace gradcomp {

// Bytes one rank sends in a ring allreduce of numel elements of dtype: what gradcomp's traffic is
// compared against, and what the uncompressed path is counted as.
uint64_t ring_allreduce_bytes(int64_t numel, DType dtype, int world);
// Bytes one rank sends in a reduce-scatter (or an allgather) of numel_per_rank elements to each of
// world ranks: (world - 1) * numel_per_rank elements.
uint64_t reduce_scatter_bytes(int64_t numel_per_rank, DType dtype, int world);

// Buffers are host memory or device memory as device_memory() says; every rank calls each
// collective with equal sizes. The public calls count bytes and time and turn a transport's
// failure into an Error naming the collective; transports implement the protected run_* ones.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual bool device_memory() const = 0;

  // recv[w] (bytes_per_rank bytes) receives send[rank()] of rank w.
  void all_to_all(const void* send, void* recv, size_t bytes_per_rank);
  // recv[w] receives rank w's send.
  void all_gather(const void* send, void* recv, size_t bytes_per_rank);
  // Averages numel elements in place over the ranks: the uncompressed path. How the mean rounds
  // is the transport's (the c10d one scales by 1/W and sums, as DDP without a hook does).
  void allreduce_mean(void* data, int64_t numel, DType dtype);
  // recv (numel_per_rank elements) receives the mean over the ranks of slice rank() of send
  // (world_size() slices of numel_per_rank elements), rounded as allreduce_mean rounds. send is
  // left as it was.
  void reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank, DType dtype);
  // The same two with each rank's slice at a stride (send_stride >= numel_per_rank elements,
  // recv_stride >= bytes_per_rank bytes): one piece of every rank's shard of a bucket, reduced
  // or gathered in place, without packing the pieces first. The same bytes and results as the
  // packed calls.
  void reduce_scatter_mean_strided(const void* send, int64_t send_stride, void* recv,
                                   int64_t numel_per_rank, DType dtype);
  void all_gather_strided(const void* send, void* recv, size_t bytes_per_rank, size_t recv_stride);

  // Bytes this rank has put on the wire (its own slot is not counted; a plain allreduce counts
  // as ring_allreduce_bytes).
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  // Host seconds spent in the calls above; on a transport that only queues work on a stream,
  // the time to queue it.
  double seconds() const { return seconds_.load(std::memory_order_relaxed); }

 protected:
  virtual void run_all_to_all(const void* send, void* recv, size_t bytes_per_rank) = 0;
  virtual void run_all_gather(const void* send, void* recv, size_t bytes_per_rank) = 0;
  virtual void run_allreduce_mean(void* data, int64_t numel, DType dtype) = 0;
  virtual void run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                                       DType dtype) = 0;
  // By default (host memory only) through a packed copy and the calls above; a transport that
  // can address the slices where they lie overrides them.
  virtual void run_reduce_scatter_mean_strided(const void* send, int64_t send_stride, void* recv,
                                               int64_t numel_per_rank, DType dtype);
  virtual void run_all_gather_strided(const void* send, void* recv, size_t bytes_per_rank,
                                      size_t recv_stride);

 private:
  template <typename F>
  void run(const char* collective, uint64_t bytes, F&& f);

  // One thread runs a transport's collectives at a time; others read the counters while it does
  // (the engine, during pipelined reductions).
  void count_bytes(uint64_t bytes);
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<double> seconds_{0};
};

}  // namespace gradcomp
