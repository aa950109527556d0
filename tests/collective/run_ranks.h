// In-process ranks for the collective tests: one thread per rank of an InProcessGroup.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

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

}  // namespace testing
}  // namespace gradcomp
