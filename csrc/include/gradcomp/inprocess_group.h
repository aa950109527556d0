// In-process ranks for testing the collective algorithms: W threads, one Communicator each.
#pragma once

#include <memory>
#include <vector>

#include "gradcomp/communicator.h"

namespace gradcomp {

// Runs W ranks in one process, each on its own thread. A collective that not every rank reaches
// within timeout_seconds raises an Error naming the missing ranks.
class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size, double timeout_seconds = 10.0);
  ~InProcessGroup();
  Communicator& communicator(int rank);
  int world_size() const;
  struct Shared;

 private:
  std::shared_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

}  // namespace gradcomp
