// OuterSync's per-fragment state and its round in flight: the blocking and overlapped paths' own.
#pragma once

#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#include "backend_buffer.h"
#include "gradcomp/outer_sync.h"

namespace gradcomp {

struct OuterSync::Fragment {
  int64_t first = 0, end = 0;  // parameter indices [first, end)
  int64_t numel = 0;
  uint32_t round = 0;
  std::vector<float> anchor, momentum;
  // The outer gradient, fp32, in the backend's memory; the allreduce's mean after a round (kept
  // there until the merge when the round is overlapped).
  detail::BackendBuffer gradient;
  // eager: the eager anchor of the round in flight (host fp32), what the merge corrects from.
  std::vector<float> eager;
  // overlap_steps > 0: the outer step taken on the round's thread (anchor and momentum after it),
  // swapped in at the merge.
  std::vector<float> next_anchor, next_momentum;
};

struct OuterSync::InFlight {
  uint32_t fragment = 0;
  uint32_t round = 0;
  uint64_t sync_step = 0, merge_step = 0;
  uint64_t sent_before = 0;  // the communicators' byte counts before the agreement
  std::thread thread;        // joinable until finish_round()
  bool finished = false;     // joined and counted (or loaded from a state)
  // Written by the thread, read after the join.
  bool finite = true;
  bool stepped = false;  // the thread took the outer step into next_anchor / next_momentum
  std::exception_ptr error;
  double seconds = 0.0;
};

}  // namespace gradcomp
