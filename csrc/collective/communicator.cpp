// The counting and timing every transport shares, and the ring-allreduce byte formula.
#include "gradcomp/communicator.h"

#include <chrono>

namespace gradcomp {
namespace {

// Adds the seconds of its scope to a counter.
class ScopedSeconds {
 public:
  explicit ScopedSeconds(double& total) : total_(total), t0_(std::chrono::steady_clock::now()) {}
  ~ScopedSeconds() {
    total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  double& total_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

uint64_t ring_allreduce_bytes(int64_t numel, DType dtype, int world) {
  return static_cast<uint64_t>(2.0 * (world - 1) / world * static_cast<double>(numel) *
                               static_cast<double>(dtype_size(dtype)));
}

void Communicator::all_to_all(const void* send, void* recv, size_t bytes_per_rank) {
  ScopedSeconds timed(seconds_);
  run_all_to_all(send, recv, bytes_per_rank);
  bytes_sent_ += bytes_per_rank * static_cast<uint64_t>(world_size() - 1);
}

void Communicator::all_gather(const void* send, void* recv, size_t bytes_per_rank) {
  ScopedSeconds timed(seconds_);
  run_all_gather(send, recv, bytes_per_rank);
  bytes_sent_ += bytes_per_rank * static_cast<uint64_t>(world_size() - 1);
}

void Communicator::allreduce_mean(void* data, int64_t numel, DType dtype) {
  ScopedSeconds timed(seconds_);
  run_allreduce_mean(data, numel, dtype);
  bytes_sent_ += ring_allreduce_bytes(numel, dtype, world_size());
}

}  // namespace gradcomp
