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
  // The fragment's parameters as the outer-step operations take them (offsets from 0).
  std::vector<OuterTensor> tensors;
  // The outer state, fp32, in the memory of the backend running the outer step (outer()): the
  // backend's own (CPU; CUDA under v2), or host memory (CUDA under v1).
  detail::BackendBuffer anchor, momentum;
  // The outer gradient, fp32, in the backend's memory; the allreduce's mean after a round (kept
  // there until the merge when the round is overlapped).
  detail::BackendBuffer gradient;
  // eager: the eager anchor of the round in flight (outer() memory), what the merge corrects
  // from; empty otherwise.
  detail::BackendBuffer eager;
  // overlap_steps > 0: the outer step taken on the round's thread (anchor and momentum after it,
  // outer() memory), swapped in at the merge.
  detail::BackendBuffer next_anchor, next_momentum;
};

// CUDA under v1: a fragment's parameters copied to host memory for the outer step there.
struct OuterSync::Staged {
  std::vector<uint8_t> bytes;        // each tensor's bytes at a 16-byte aligned offset
  std::vector<OuterTensor> tensors;  // the fragment's tensors, pointing into `bytes` when staged
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
