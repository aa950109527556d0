// Streaming DiLoCo's overlap: a fragment's allreduce on a thread of OuterSync, merged tau steps on.
#include <chrono>
#include <exception>
#include <sstream>
#include <string>
#include <utility>

#include "gradcomp/outer_sync.h"
#include "outer_sync_parts.h"

namespace gradcomp {
namespace {

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void OuterSync::start_round(uint32_t index) {
  GRADCOMP_CHECK(!in_flight_, "DiLoCo: fragment " << index << " is due while fragment "
                                                  << in_flight_->fragment
                                                  << "'s round is still in flight");
  const auto start = std::chrono::steady_clock::now();
  uint64_t sent_before = 0;
  for (const Communicator* c : comms_) sent_before += c->bytes_sent();
  Fragment& f = fragments_[index];
  prepare(f);
  if (options_.eager) take_eager_step(f);
  // The copies the round's thread steps into, taken here: the thread allocates nothing.
  const size_t bytes = static_cast<size_t>(f.numel) * sizeof(float);
  f.next_anchor = round_buffers_->take(outer(), bytes);
  f.next_momentum = round_buffers_->take(outer(), bytes);
  auto round = std::make_unique<InFlight>();
  round->fragment = index;
  round->round = f.round;
  round->sync_step = inner_step_;
  round->merge_step = inner_step_ + options_.overlap_steps;
  round->sent_before = sent_before;
  InFlight* r = round.get();
  // Until the join the thread alone touches the communicators, the allreduce (its residuals) and
  // the fragment's gradient buffer; the caller's inner steps write only the parameters, which the
  // round never reads. The agreement runs there too: on the caller's thread a rank ahead of the
  // others would wait for them at every sync point, where its inner steps can go on; the round's
  // allreduce waits for them anyway. Nothing escapes the thread: its error waits for the merge
  // (a disagreement too: found before the allreduce mixes anything, but after an eager step has
  // moved this rank's parameters, so it spends the object as any failed round does).
  round->thread = std::thread([this, r] {
    const auto begin = std::chrono::steady_clock::now();
    try {
      if (round_thread_setup_) round_thread_setup_();
      agree(r->fragment, r->sync_step);
      r->agreed = true;
      r->finite = reduce(r->fragment);
      // The outer step, here rather than at the merge on the caller's thread: on copies, since
      // state() may still save the anchor it starts from. Nothing else touches this fragment's
      // anchor and momentum until the join (the eager step read them before the thread began).
      if (r->finite) {
        Fragment& fr = fragments_[r->fragment];
        outer_step(fr, reinterpret_cast<float*>(fr.next_anchor.get()),
                   reinterpret_cast<float*>(fr.next_momentum.get()), false);
        r->stepped = true;
      }
    } catch (...) {
      r->error = std::current_exception();
    }
    r->seconds = since(begin);
  });
  in_flight_ = std::move(round);
  const double seconds = since(start);
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.seconds += seconds;
}

void OuterSync::take_eager_step(Fragment& f) {
  // Before the round's thread exists: the allreduce replaces this rank's g with the mean in place.
  // The shared buffer takes only the global step, at the merge: this one's update is dropped.
  f.eager = round_buffers_->take(outer(), static_cast<size_t>(f.numel) * sizeof(float));
  outer_step(f, reinterpret_cast<float*>(f.eager.get()), nullptr, true);
}

void OuterSync::finish_round() {
  InFlight& r = *in_flight_;
  if (r.finished) return;
  const auto start = std::chrono::steady_clock::now();
  r.thread.join();
  r.finished = true;
  const double waited = since(start);
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.seconds += waited;
    stats_.wait_seconds += waited;
    stats_.background_seconds += r.seconds;
  }
  if (r.error) {
    std::string what = "an unknown error";
    try {
      std::rethrow_exception(r.error);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    std::ostringstream m;
    m << "DiLoCo: the background round of fragment " << r.fragment << " (round " << r.round
      << ", synced after inner step " << r.sync_step << ") failed: " << what;
    if (r.agreed) {
      m << ". The outer state is now unknown: load a checkpoint to go on";
    } else {
      m << ". Nothing was allreduced"
        << (options_.eager ? ", but this rank's parameters took its own eager outer step" : "")
        << ": make the ranks agree and load a checkpoint on every rank to go on";
    }
    failed_ = m.str();
    in_flight_.reset();
    GRADCOMP_CHECK(false, failed_);
  }
  count_round(fragments_[r.fragment], r.sent_before, r.finite);
}

bool OuterSync::flush() {
  GRADCOMP_CHECK(failed_.empty(), failed_);
  if (!in_flight_) return false;
  merge_round();
  return true;
}

void OuterSync::merge_round() {
  finish_round();
  const auto start = std::chrono::steady_clock::now();
  apply(in_flight_->fragment, in_flight_->finite, in_flight_->stepped);
  Fragment& f = fragments_[in_flight_->fragment];
  round_buffers_->keep(std::move(f.eager));
  round_buffers_->keep(std::move(f.next_anchor));
  round_buffers_->keep(std::move(f.next_momentum));
  in_flight_.reset();
  const double seconds = since(start);
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.seconds += seconds;
}

}  // namespace gradcomp
