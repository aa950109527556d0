// In-process ranks for the collective tests: one thread per rank of an InProcessGroup.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/collectives.h"
#include "gradcomp/inprocess_group.h"

namespace gradcomp {
namespace testing {

// Runs fn(rank, communicator) on one thread per rank; rethrows the first failure.
inline void run_ranks(InProcessGroup& group, const std::function<void(int, Communicator&)>& fn,
                      std::vector<std::string>* errors = nullptr) {
  const int world = group.world_size();
  std::vector<std::exception_ptr> failures(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, group.communicator(r));
      } catch (...) {
        failures[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    if (!failures[r]) continue;
    if (errors == nullptr) std::rethrow_exception(failures[r]);
    try {
      std::rethrow_exception(failures[r]);
    } catch (const std::exception& e) {
      errors->push_back(e.what());
    }
  }
}

// Simulated nodes: `nodes` x `local` in-process ranks, node-major (rank = node * local + local
// rank), with an intra-node group per node and an inter-node group per local rank.
class NodeGrid {
 public:
  NodeGrid(int nodes, int local, double timeout_seconds = 10.0) : nodes_(nodes), local_(local) {
    for (int n = 0; n < nodes; ++n)
      intra_.push_back(std::make_unique<InProcessGroup>(local, timeout_seconds));
    for (int l = 0; l < local; ++l)
      inter_.push_back(std::make_unique<InProcessGroup>(nodes, timeout_seconds));
  }
  int world_size() const { return nodes_ * local_; }
  NodeGroups groups(int rank) {
    return {&intra_[rank / local_]->communicator(rank % local_),
            &inter_[rank % local_]->communicator(rank / local_)};
  }

 private:
  int nodes_, local_;
  std::vector<std::unique_ptr<InProcessGroup>> intra_, inter_;
};

// Runs fn(rank, groups) on one thread per rank of the grid; rethrows the first failure.
inline void run_grid(NodeGrid& grid, const std::function<void(int, NodeGroups)>& fn,
                     std::vector<std::string>* errors = nullptr) {
  InProcessGroup threads(grid.world_size());
  run_ranks(
      threads, [&](int rank, Communicator&) { fn(rank, grid.groups(rank)); }, errors);
}

}  // namespace testing
}  // namespace gradcomp
