// OuterSync's per-fragment state and its round in flight: the blocking and overlapped paths' own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>
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

// The buffers a round uses, kept for the next round rather than released: a round then
// allocates and zeroes nothing (a fresh 4-byte-per-parameter buffer costs a page fault per 4 KiB
// on the caller's thread, and cudaMalloc / cudaFree wait for the device).
struct OuterSync::RoundBuffers {
  // The copies a round steps into (next anchor and momentum, eager anchor): each as large as the
  // largest fragment, so any fragment's round fits; at most three are kept, the peak a round in
  // flight needs anyway.
  size_t capacity = 0;  // the largest fragment's fp32 bytes
  std::vector<detail::BackendBuffer> kept;
  // The agreement's send and receive buffers, per group in OuterSync::agreement_.
  std::vector<std::pair<detail::BackendBuffer, detail::BackendBuffer>> agreement;

  detail::BackendBuffer take(Backend& backend, size_t bytes) {
    if (kept.empty()) return detail::BackendBuffer(backend, bytes, capacity);
    detail::BackendBuffer b = std::move(kept.back());
    kept.pop_back();
    b.resize(bytes);
    return b;
  }
  // A smaller buffer (a fragment's first anchor or momentum, allocated at its own size) is
  // released: kept, it would not fit a larger fragment's round.
  void keep(detail::BackendBuffer b) {
    if (b.get() != nullptr && b.capacity() >= capacity && kept.size() < 3)
      kept.push_back(std::move(b));
  }
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
  bool agreed = false;  // the ranks' agreement passed (what failed, if anything, came after)
  bool finite = true;
  bool stepped = false;  // the thread took the outer step into next_anchor / next_momentum
  std::exception_ptr error;
  double seconds = 0.0;
};

}  // namespace gradcomp
