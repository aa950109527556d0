// For tests only: a Communicator that forwards to another and breaks one collective on purpose,
// as a broken or dead peer would. Never part of a production path: front ends wrap their
// transport in it only when a test asks.
#pragma once

#include <string>

#include "gradcomp/communicator.h"

namespace gradcomp {

struct FaultSpec {
  enum class Action : uint8_t {
    kNone,
    kFlipBits,  // three bits of `rank`'s slot flipped, as every rank receives it
    kTruncate,  // `rank`'s slot cut short: its second half zeroed
    kReplace,   // `rank`'s slot replaced by pseudo-random bytes
    kFail,      // on `rank`, the collective raises (a transport that gave up)
    kPause,     // on `rank`, the collective never returns: it creates `pause_file` and sleeps,
                // for the test to kill the process there
  };
  Action action = Action::kNone;
  std::string collective = "all_gather";  // all_to_all, all_gather, allreduce, reduce_scatter
  uint64_t call = 0;                      // which call of that collective on this rank, from 0
  int rank = 0;
  bool after = false;  // kFail / kPause: after the collective's data moved instead of before
  std::string pause_file;
  uint64_t seed = 1;

  static Action parse_action(const std::string& name);
};

class FaultInjectingCommunicator final : public Communicator {
 public:
  FaultInjectingCommunicator(Communicator& inner, FaultSpec spec);
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  bool device_memory() const override { return inner_.device_memory(); }

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes_per_rank) override;
  void run_all_gather(const void* send, void* recv, size_t bytes_per_rank) override;
  void run_allreduce_mean(void* data, int64_t numel, DType dtype) override;
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                               DType dtype) override;

 private:
  // Whether this call is the one to break; counts the calls of each collective.
  bool strikes(const char* collective);
  [[noreturn]] void misbehave();  // kFail raises; kPause never returns
  void before(bool strike);
  void after(bool strike, uint8_t* slots, size_t bytes_per_rank);

  Communicator& inner_;
  FaultSpec spec_;
  uint64_t calls_[4] = {0, 0, 0, 0};
};

}  // namespace gradcomp
