// DiLoCo's outer rounds over the compressed allreduce: fragments, their schedule, the outer step.
#include "gradcomp/outer_sync.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include "backend_buffer.h"
#include "outer_sync_parts.h"

namespace gradcomp {

void OuterSyncOptions::validate() const {
  GRADCOMP_CHECK(inner_steps >= 1, "DiLoCo inner_steps must be at least 1, got " << inner_steps);
  GRADCOMP_CHECK(outer_lr > 0.0f && std::isfinite(outer_lr),
                 "DiLoCo outer_lr must be positive, got " << outer_lr);
  GRADCOMP_CHECK(outer_momentum >= 0.0f && outer_momentum < 1.0f,
                 "DiLoCo outer_momentum must be in [0, 1), got " << outer_momentum);
  GRADCOMP_CHECK(!nesterov || outer_momentum > 0.0f,
                 "DiLoCo nesterov needs outer_momentum > 0 (as torch.optim.SGD's does)");
  GRADCOMP_CHECK(
      fragments >= 1 && fragments <= inner_steps,
      "DiLoCo fragments must be in [1, inner_steps = " << inner_steps << "], got " << fragments);
  GRADCOMP_CHECK(uint64_t{overlap_steps} * fragments < inner_steps,
                 "DiLoCo overlap_steps (tau) = "
                     << overlap_steps << " must be below inner_steps / fragments = " << inner_steps
                     << " / " << fragments
                     << ": a fragment's round merges before the next fragment's sync starts");
  GRADCOMP_CHECK(mixing >= 0.0f && mixing <= 1.0f,
                 "DiLoCo mixing (alpha) must be in [0, 1], got " << mixing);
  GRADCOMP_CHECK(!eager || overlap_steps > 0,
                 "DiLoCo eager updates need overlap_steps (tau) > 0: without overlap the global "
                 "update is there at once");
  GRADCOMP_CHECK(!eager || mixing == 0.0f,
                 "DiLoCo eager updates take mixing (alpha) = 0, got "
                     << mixing << ": the eager merge keeps the tau steps' local progress itself");
}

OuterSync::OuterSync(Communicator& comm, Backend& backend, const CompressionConfig& config,
                     const OuterSyncOptions& options, std::vector<OuterParam> params)
    : backend_(backend), options_(options) {
  options_.validate();
  allreduce_ = std::make_unique<CompressedAllreduce>(comm, backend, config);
  world_ = comm.world_size();
  agreement_ = {{&comm, "the group"}};
  comms_ = {&comm};
  init(std::move(params));
}

OuterSync::OuterSync(NodeGroups groups, Backend& backend, const CompressionConfig& config,
                     const OuterSyncOptions& options, std::vector<OuterParam> params)
    : backend_(backend), options_(options) {
  options_.validate();
  GRADCOMP_CHECK(groups.intra_node != nullptr && groups.inter_node != nullptr,
                 "DiLoCo's hierarchical allreduce needs both node groups");
  allreduce_ = std::make_unique<CompressedAllreduce>(groups, backend, config);
  world_ = groups.intra_node->world_size() * groups.inter_node->world_size();
  agreement_ = {{groups.intra_node, "this node"}, {groups.inter_node, "the group across nodes"}};
  nodes_ = groups.inter_node->world_size();
  comms_ = {groups.intra_node, groups.inter_node};
  init(std::move(params));
}

OuterSync::~OuterSync() {
  // The round's thread uses this object: it finishes (or its transport times out) first. Its
  // error, if any, is dropped with the object.
  if (in_flight_ && in_flight_->thread.joinable()) in_flight_->thread.join();
}

void OuterSync::init(std::vector<OuterParam> params) {
  GRADCOMP_CHECK(allreduce_->config().remedies.momentum == 0.0f,
                 "DiLoCo: TopK momentum correction does not apply to outer gradients (the outer "
                 "optimizer has its own momentum); use TopK(momentum=0)");
  GRADCOMP_CHECK(params.size() >= options_.fragments,
                 "DiLoCo fragments = " << options_.fragments << " but only " << params.size()
                                       << " parameter tensors to split among them");
  // Under v1 the outer step stages through host memory, which the round's thread and the inner
  // steps would share; the v2 kernels keep it on the backend's stream.
  GRADCOMP_CHECK(options_.overlap_steps == 0 || backend_.outer_unsupported() == nullptr,
                 "DiLoCo overlap_steps (tau) > 0 on CUDA needs the outer step on the device: set "
                 "GRADCOMP_KERNELS=v2 (or kernels=\"v2\" in the codec spec), or use "
                 "overlap_steps=0");
  if (backend_.outer_unsupported() != nullptr) host_ = make_cpu_backend(1);
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    GRADCOMP_CHECK(params[i].numel > 0 && params[i].data != nullptr,
                   "DiLoCo parameter " << i << " is empty or has no memory");
    total += params[i].numel;
  }
  params_ = std::move(params);
  // Contiguous fragments cut where the running count first reaches f / F of the elements, each
  // holding at least one tensor.
  const int64_t n = static_cast<int64_t>(params_.size());
  const int64_t count = options_.fragments;
  fragments_.resize(static_cast<size_t>(count));
  round_buffers_ = std::make_unique<RoundBuffers>();
  int64_t i = 0, seen = 0;
  for (int64_t f = 0; f < count; ++f) {
    Fragment& fr = fragments_[static_cast<size_t>(f)];
    fr.first = i;
    const int64_t target = total / count * (f + 1) + (f + 1 == count ? total % count : 0);
    do {
      seen += params_[static_cast<size_t>(i)].numel;
      fr.numel += params_[static_cast<size_t>(i)].numel;
      ++i;
    } while (i < n - (count - 1 - f) && seen < target);
    if (f + 1 == count) {
      for (; i < n; ++i) fr.numel += params_[static_cast<size_t>(i)].numel;
    }
    fr.end = i;
    int64_t offset = 0;
    for (int64_t t = fr.first; t < fr.end; ++t) {
      const OuterParam& p = params_[static_cast<size_t>(t)];
      fr.tensors.push_back({p.data, p.numel, offset, static_cast<uint8_t>(p.dtype)});
      offset += p.numel;
    }
    const size_t bytes = static_cast<size_t>(fr.numel) * sizeof(float);
    round_buffers_->capacity = std::max(round_buffers_->capacity, bytes);
    fr.momentum = detail::BackendBuffer(outer(), bytes);  // zero bits: 0.0f
    fr.anchor = detail::BackendBuffer(outer(), bytes);
    fr.gradient = detail::BackendBuffer(backend_, bytes);
    // The first anchor: the parameters widened to fp32 (a gradient without an anchor).
    const Staged staged = stage(fr, true);
    OuterGradientParams load;
    load.tensors = staged.tensors.data();
    load.num_tensors = static_cast<int>(staged.tensors.size());
    load.numel = fr.numel;
    load.gradient = reinterpret_cast<float*>(fr.anchor.get());
    outer().outer_gradient(load);
  }
}

uint32_t OuterSync::fragments() const {
  return static_cast<uint32_t>(fragments_.size());
}

std::vector<int64_t> OuterSync::fragment_params(uint32_t fragment) const {
  GRADCOMP_CHECK(fragment < fragments_.size(),
                 "DiLoCo fragment " << fragment << " of " << fragments_.size());
  std::vector<int64_t> out;
  for (int64_t i = fragments_[fragment].first; i < fragments_[fragment].end; ++i) out.push_back(i);
  return out;
}

bool OuterSync::due(uint32_t fragment, uint64_t t) const {
  const uint64_t h = options_.inner_steps;
  const uint64_t offset = uint64_t{fragment} * h / fragments_.size();
  return t >= 1 && t % h == offset;
}

OuterSyncStats OuterSync::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

int OuterSync::step() {
  GRADCOMP_CHECK(failed_.empty(), failed_);
  ++inner_step_;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.inner_steps;
  }
  // The merge first: it may fall on the next fragment's sync point.
  if (in_flight_ && in_flight_->merge_step == inner_step_) merge_round();
  int synced = 0;
  for (uint32_t f = 0; f < fragments_.size(); ++f) {
    if (!due(f, inner_step_)) continue;
    if (options_.overlap_steps > 0) {
      start_round(f);
    } else {
      sync_fragment(f);
    }
    ++synced;
  }
  return synced;
}

void OuterSync::agree(uint32_t fragment, uint64_t inner_step) {
  struct Position {
    uint64_t inner_step;
    uint32_t fragment, round, inner_steps, fragments;
    uint32_t overlap_steps;
    uint32_t eager;
    uint32_t mixing_bits;  // alpha's bits
    // Set by a rank that found a disagreement at an earlier level (inside its node): it still
    // takes part in the next levels' allgathers, so that every node learns of it and raises
    // instead of waiting out the timeout for ranks that already left.
    uint32_t disagreed;
  };
  // Eight 32-bit fields after the step: no padding, so no indeterminate bytes on the wire.
  static_assert(sizeof(Position) == 8 + 8 * 4, "DiLoCo's Position has padding");
  Position mine{inner_step,
                fragment,
                fragments_[fragment].round,
                options_.inner_steps,
                static_cast<uint32_t>(fragments_.size()),
                options_.overlap_steps,
                options_.eager ? 1u : 0u,
                0,
                0};
  std::memcpy(&mine.mixing_bits, &options_.mixing, sizeof(float));
  std::string error;
  auto& buffers = round_buffers_->agreement;
  buffers.resize(agreement_.size());
  for (size_t g = 0; g < agreement_.size(); ++g) {
    const auto& [comm, name] = agreement_[g];
    const int world = comm->world_size();
    if (world == 1) continue;
    std::vector<Position> all(static_cast<size_t>(world));
    auto& [send, recv] = buffers[g];
    if (send.get() == nullptr) {
      send = detail::BackendBuffer(backend_, sizeof(Position));
      recv = detail::BackendBuffer(backend_, sizeof(Position) * all.size());
    }
    backend_.copy_from_host(send.get(), &mine, sizeof(Position));
    try {
      comm->all_gather(send.get(), recv.get(), sizeof(Position));
    } catch (const std::exception& e) {
      // A peer that died or went silent: say whose sync it was, not only which bytes failed.
      GRADCOMP_CHECK(false, "DiLoCo: the ranks' agreement before fragment "
                                << fragment << "'s round " << mine.round << " (inner step "
                                << mine.inner_step << ") failed on rank " << comm->rank() << " of "
                                << name << ": " << e.what());
    }
    backend_.copy_to_host(all.data(), recv.get(), sizeof(Position) * all.size());
    for (int w = 0; w < world && error.empty(); ++w) {
      const Position& o = all[static_cast<size_t>(w)];
      std::ostringstream m;
      if (o.disagreed != 0) {
        m << "DiLoCo: ranks disagree before a sync: rank " << w << " of " << name
          << " found ranks of its node at different positions (its error names them); this rank "
          << "(rank " << comm->rank() << " of " << name << ") is at inner step " << mine.inner_step
          << ", fragment " << mine.fragment << " round " << mine.round;
      } else if (o.inner_step != mine.inner_step || o.fragment != mine.fragment ||
                 o.round != mine.round || o.inner_steps != mine.inner_steps ||
                 o.fragments != mine.fragments || o.overlap_steps != mine.overlap_steps ||
                 o.eager != mine.eager || o.mixing_bits != mine.mixing_bits) {
        m << "DiLoCo: ranks disagree before a sync: this rank (rank " << comm->rank() << " of "
          << name << ") is at inner step " << mine.inner_step << ", fragment " << mine.fragment
          << " round " << mine.round << " (H " << mine.inner_steps << ", " << mine.fragments
          << " fragments); rank " << w << " at inner step " << o.inner_step << ", fragment "
          << o.fragment << " round " << o.round << " (H " << o.inner_steps << ", " << o.fragments
          << " fragments). Every rank must run with the same H and fragments and resume from "
             "the same round";
        if (o.overlap_steps != mine.overlap_steps)
          m << " (and overlap_steps: " << mine.overlap_steps << " here, " << o.overlap_steps
            << " on rank " << w << ")";
        if (o.eager != mine.eager || o.mixing_bits != mine.mixing_bits)
          m << " (and eager / mixing: " << (mine.eager ? "eager" : "not eager") << " here, "
            << (o.eager ? "eager" : "not eager") << " on rank " << w
            << "; the mixing may differ too)";
      }
      error = m.str();
    }
    if (!error.empty()) mine.disagreed = 1;
  }
  GRADCOMP_CHECK(error.empty(), error);
}

void OuterSync::sync_fragment(uint32_t index) {
  GRADCOMP_CHECK(failed_.empty(), failed_);
  GRADCOMP_CHECK(index < fragments_.size(),
                 "DiLoCo fragment " << index << " of " << fragments_.size());
  GRADCOMP_CHECK(!in_flight_, "DiLoCo: sync_fragment(" << index << ") while fragment "
                                                       << (in_flight_ ? in_flight_->fragment : 0)
                                                       << "'s round is in flight; flush() first");
  const auto start = std::chrono::steady_clock::now();
  // Bytes are counted where they are sent: by the communicators, around everything this sync puts
  // on the wire (the agreement and the allreduce).
  uint64_t sent_before = 0;
  for (const Communicator* c : comms_) sent_before += c->bytes_sent();
  agree(index, inner_step_);
  prepare(fragments_[index]);
  bool finite = false;
  try {
    finite = reduce(index);
  } catch (const PayloadError&) {
    throw;  // already names the sender; counted as a rejected payload
  } catch (const std::exception& e) {
    GRADCOMP_CHECK(false, "DiLoCo: the round of fragment "
                              << index << " (round " << fragments_[index].round << ", inner step "
                              << inner_step_ << ") failed: " << e.what());
  }
  count_round(fragments_[index], sent_before, finite);
  apply(index, finite, false);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.seconds += seconds;
}

bool OuterSync::reduce(uint32_t index) {
  const Fragment& f = fragments_[index];
  allreduce_->set_step(f.round);
  const Segment segment{f.gradient.get(), 0, f.numel};
  return allreduce_->allreduce(&segment, 1, DType::kFloat32, index);
}

void OuterSync::count_round(const Fragment& f, uint64_t sent_before, bool finite) {
  uint64_t sent_after = 0;
  for (const Communicator* c : comms_) sent_after += c->bytes_sent();
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.bytes_sent += sent_after - sent_before;
  stats_.uncompressed_bytes += ring_allreduce_bytes(f.numel, DType::kFloat32, world_);
  ++stats_.rounds;
  if (!finite) ++stats_.nonfinite_rounds;
}

OuterSyncState OuterSync::state() {
  GRADCOMP_CHECK(failed_.empty(), failed_);
  OuterSyncState s;
  if (in_flight_) {
    // Finished, then saved: the mean is kept and merges at its step after a load, as it would
    // have here, so a resume is bit-exact whatever the round's timing.
    finish_round();
    const Fragment& f = fragments_[in_flight_->fragment];
    OuterPendingRound p;
    p.fragment = in_flight_->fragment;
    p.merge_step = in_flight_->merge_step;
    p.finite = in_flight_->finite;
    p.mean.resize(static_cast<size_t>(f.numel));
    backend_.copy_to_host(p.mean.data(), f.gradient.get(), p.mean.size() * sizeof(float));
    if (f.eager.get() != nullptr) {
      p.eager.resize(p.mean.size());
      outer().copy_to_host(p.eager.data(), f.eager.get(), p.eager.size() * sizeof(float));
    }
    s.pending.push_back(std::move(p));
  }
  s.inner_steps = options_.inner_steps;
  s.inner_step = inner_step_;
  for (const Fragment& f : fragments_) {
    const size_t n = static_cast<size_t>(f.numel);
    s.rounds.push_back(f.round);
    s.anchors.emplace_back(n);
    s.momenta.emplace_back(n);
    outer().copy_to_host(s.anchors.back().data(), f.anchor.get(), n * sizeof(float));
    outer().copy_to_host(s.momenta.back().data(), f.momentum.get(), n * sizeof(float));
  }
  s.compression = allreduce_->state();
  return s;
}

void OuterSync::load_state(const OuterSyncState& s) {
  const size_t count = fragments_.size();
  GRADCOMP_CHECK(s.inner_steps == options_.inner_steps, "DiLoCo state saved with inner_steps (H) "
                                                            << s.inner_steps << ", this run has "
                                                            << options_.inner_steps);
  GRADCOMP_CHECK(s.rounds.size() == count && s.anchors.size() == count && s.momenta.size() == count,
                 "DiLoCo state has " << s.rounds.size() << " fragment rounds, " << s.anchors.size()
                                     << " anchors and " << s.momenta.size()
                                     << " momenta; this run has " << count << " fragments");
  for (size_t f = 0; f < count; ++f) {
    const size_t n = static_cast<size_t>(fragments_[f].numel);
    GRADCOMP_CHECK(s.anchors[f].size() == n && s.momenta[f].size() == n,
                   "DiLoCo state's fragment " << f << " holds " << s.anchors[f].size()
                                              << " elements, this run's holds " << n
                                              << " (another model or fragment split)");
    for (size_t e = 0; e < n; ++e)
      GRADCOMP_CHECK(std::isfinite(s.anchors[f][e]) && std::isfinite(s.momenta[f][e]),
                     "DiLoCo state's fragment " << f << " holds a non-finite anchor or momentum "
                                                << "at element " << e);
  }
  GRADCOMP_CHECK(s.pending.empty() || options_.overlap_steps > 0,
                 "DiLoCo state holds a round in flight (saved with overlap_steps > 0); this run "
                 "has overlap_steps = 0");
  GRADCOMP_CHECK(s.pending.size() <= 1,
                 "DiLoCo state holds " << s.pending.size() << " rounds in flight, at most 1");
  for (const OuterPendingRound& p : s.pending) {
    GRADCOMP_CHECK(
        p.fragment < count && p.mean.size() == static_cast<size_t>(fragments_[p.fragment].numel),
        "DiLoCo state's round in flight is of fragment "
            << p.fragment << " with " << p.mean.size()
            << " elements, which this run's fragments do not match");
    GRADCOMP_CHECK(
        p.merge_step > s.inner_step && p.merge_step <= s.inner_step + options_.overlap_steps,
        "DiLoCo state's round in flight merges after inner step "
            << p.merge_step << ", not within overlap_steps = " << options_.overlap_steps
            << " of the state's inner step " << s.inner_step);
    const size_t want = options_.eager ? p.mean.size() : 0;
    GRADCOMP_CHECK(p.eager.size() == want,
                   "DiLoCo state's round in flight holds "
                       << p.eager.size() << " eager anchor values, this run (eager = "
                       << (options_.eager ? "true" : "false") << ") needs " << want
                       << ": resume with the eager setting of the run that saved it");
  }
  // Residuals: only of this run's fragments, each of the size its allreduce keeps.
  const int local = allreduce_->local_world_size();
  const int peers = world_ / local;  // the ranks each shard's compressed allreduce spans
  auto check = [&](const std::map<uint64_t, std::vector<uint8_t>>& m, bool chunk) {
    for (const auto& [id, bytes] : m) {
      GRADCOMP_CHECK(id < count, "DiLoCo state holds a residual of fragment "
                                     << id << " but this run has " << count << " fragments");
      const int64_t numel =
          local > 1 ? node_shard_numel(fragments_[id].numel, local) : fragments_[id].numel;
      const uint64_t want = chunk ? chunk_residual_bytes(allreduce_->config(), numel, peers)
                                  : residual_bytes(allreduce_->config(), numel);
      GRADCOMP_CHECK(bytes.size() == want,
                     "DiLoCo state's " << (chunk ? "chunk " : "") << "residual of fragment " << id
                                       << " holds " << bytes.size() << " bytes, this run keeps "
                                       << want << " (another world size or codec)");
    }
  };
  check(s.compression.residuals, false);
  check(s.compression.chunk_residuals, true);
  // A round of this object still running writes residuals: it ends before they are replaced.
  if (in_flight_ && in_flight_->thread.joinable()) in_flight_->thread.join();
  in_flight_.reset();
  failed_.clear();
  allreduce_->load_state(s.compression);
  inner_step_ = s.inner_step;
  for (size_t f = 0; f < count; ++f) {
    Fragment& fr = fragments_[f];
    fr.round = s.rounds[f];
    outer().copy_from_host(fr.anchor.get(), s.anchors[f].data(), fr.anchor.bytes());
    outer().copy_from_host(fr.momentum.get(), s.momenta[f].data(), fr.momentum.bytes());
    round_buffers_->keep(std::move(fr.eager));
    round_buffers_->keep(std::move(fr.next_anchor));
    round_buffers_->keep(std::move(fr.next_momentum));
  }
  for (const OuterPendingRound& p : s.pending) {
    Fragment& f = fragments_[p.fragment];
    backend_.copy_from_host(f.gradient.get(), p.mean.data(), p.mean.size() * sizeof(float));
    in_flight_ = std::make_unique<InFlight>();
    in_flight_->fragment = p.fragment;
    in_flight_->round = f.round;
    in_flight_->merge_step = p.merge_step;
    in_flight_->sync_step = p.merge_step - options_.overlap_steps;
    in_flight_->finished = true;  // its bytes were counted by the run that saved it
    in_flight_->finite = p.finite;
    if (!p.eager.empty()) {
      f.eager = round_buffers_->take(outer(), p.eager.size() * sizeof(float));
      outer().copy_from_host(f.eager.get(), p.eager.data(), p.eager.size() * sizeof(float));
    }
  }
}

}  // namespace gradcomp
