// The compressed reduce-scatter: rows encoded one by one, an all-to-all, the own row decoded and
// reduced in fp32; residuals per bucket and their checkpoint.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "backend_buffer.h"
#include "codec_params.h"
#include "gradcomp/cpu.h"
#include "gradcomp/format.h"
#include "gradcomp/reduce_scatter.h"
#include "layout_check.h"

namespace gradcomp {
namespace {

using Buffer = detail::BackendBuffer;

// Row r's random bits: phases 0 and 1 are the allreduce's two phases.
constexpr uint32_t kFirstRowPhase = 2;

uint64_t slot_bytes_of(const CompressionConfig& config, int64_t shard_numel) {
  if (config.codec == Codec::kQ4) return q4_payload_bytes(shard_numel, config.q4.block_size);
  return topk_payload_bytes(topk_capacity(shard_numel, config.topk), config.topk.value_dtype);
}

// One NaN of dtype, as the backends read it.
std::vector<uint8_t> nan_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: {
      const uint32_t bits = 0x7fc00000u;
      std::vector<uint8_t> b(4);
      std::memcpy(b.data(), &bits, 4);
      return b;
    }
    case DType::kBFloat16:
      return {0xc0, 0x7f};
    case DType::kFloat16:
      return {0x00, 0x7e};
  }
  GRADCOMP_CHECK(false, "no NaN for dtype code " << int(dtype));
}

}  // namespace

uint64_t compressed_reduce_scatter_bytes_sent(const CompressionConfig& config, int64_t shard_numel,
                                              int world) {
  return static_cast<uint64_t>(world - 1) * slot_bytes_of(config, shard_numel);
}

uint64_t reduce_scatter_residual_bytes(const CompressionConfig& config, int64_t shard_numel,
                                       int world) {
  if (!config.error_feedback) return 0;
  return static_cast<uint64_t>(shard_numel) * world * dtype_size(config.residual_dtype);
}

struct CompressedReduceScatter::Bucket {
  uint64_t id = 0;
  int64_t shard = 0;
  DType dtype = DType::kFloat32;
  bool layout_checked = false;
  int current = 0;  // which residual buffer holds the committed residual
  Buffer residual[2];
  Buffer send, recv, workspace, nan;
  Buffer poison;  // v2 on CUDA: the input's non-finite flag, read by the encodes on the device
  uint64_t slot_bytes = 0;
};

CompressedReduceScatter::CompressedReduceScatter(Communicator& comm, Backend& backend,
                                                 const CompressionConfig& config)
    : comm_(comm), backend_(backend), config_(config) {
  config_.validate();
  GRADCOMP_CHECK(config_.codec != Codec::kQ2,
                 "the compressed reduce-scatter does not take Q2: Q2 is meant for DiLoCo's outer "
                 "gradients (use Q4 or TopK)");
  GRADCOMP_CHECK(comm.device_memory() == backend.is_cuda(),
                 "communicator and backend disagree on host versus device memory");
  GRADCOMP_CHECK(config_.codec == Codec::kQ4 ||
                     (!config_.remedies.any() && config_.remedies.warmup_steps == 0),
                 "the compressed reduce-scatter takes top-k without remedies (warm-up, momentum "
                 "correction, clipping): they are defined on a whole bucket's allreduce");
  pending_.seed = config_.seed;
  // The v2 q4 and top-k kernels read the poison word and report their checks on the device.
  device_decides_ =
      backend_.is_cuda() && resolve_kernel_generation(config_.kernels) == KernelGeneration::kV2;
}

CompressedReduceScatter::~CompressedReduceScatter() = default;

CompressedReduceScatter::Bucket& CompressedReduceScatter::bucket_for(
    const ReduceScatterRequest& r) {
  const int world = comm_.world_size();
  auto it = buckets_.find(r.bucket_id);
  if (it != buckets_.end()) {
    Bucket& b = *it->second;
    GRADCOMP_CHECK(b.shard == r.shard_numel && b.dtype == r.dtype,
                   "reduce-scatter bucket "
                       << r.bucket_id << " on rank " << comm_.rank() << " changed from shards of "
                       << b.shard << " " << dtype_name(b.dtype) << " elements to " << r.shard_numel
                       << " " << dtype_name(r.dtype)
                       << "; use a new bucket identity for a new layout");
    return b;
  }
  GRADCOMP_CHECK(r.shard_numel > 0, "reduce-scatter bucket " << r.bucket_id << " on rank "
                                                             << comm_.rank() << " has shards of "
                                                             << r.shard_numel << " elements");
  if (config_.codec == Codec::kTopK) {
    GRADCOMP_CHECK(r.shard_numel <= kTopKMaxNumel,
                   "reduce-scatter bucket " << r.bucket_id << " on rank " << comm_.rank()
                                            << " has shards of " << r.shard_numel
                                            << " elements; top-k allows at most 2^31 - 1");
  }
  auto b = std::make_unique<Bucket>();
  b->id = r.bucket_id;
  b->shard = r.shard_numel;
  b->dtype = r.dtype;
  b->slot_bytes = slot_bytes_of(config_, r.shard_numel);
  b->send = Buffer(backend_, b->slot_bytes * world);
  b->recv = Buffer(backend_, b->slot_bytes * world);
  const std::vector<uint8_t> nan = nan_bytes(r.dtype);
  b->nan = Buffer(backend_, nan.size());
  backend_.copy_from_host(b->nan.get(), nan.data(), nan.size());
  if (device_decides_) b->poison = Buffer(backend_, sizeof(uint32_t));
  if (config_.codec == Codec::kTopK) {
    const size_t ws = backend_.topk_workspace_bytes(r.shard_numel);
    if (ws > 0) b->workspace = Buffer(backend_, ws);
  }
  const uint64_t rbytes = reduce_scatter_residual_bytes(config_, r.shard_numel, world);
  if (rbytes > 0) {
    for (auto& res : b->residual) res = Buffer(backend_, rbytes);
  }
  auto restored = pending_.residuals.find(r.bucket_id);
  if (restored != pending_.residuals.end()) {
    GRADCOMP_CHECK(restored->second.size() == rbytes,
                   "checkpoint residual for reduce-scatter bucket "
                       << r.bucket_id << " on rank " << comm_.rank() << " has "
                       << restored->second.size() << " bytes, the bucket needs " << rbytes << " ("
                       << world << " rows of " << r.shard_numel
                       << " elements); was it saved at another world size?");
    backend_.copy_from_host(b->residual[0].get(), restored->second.data(), rbytes);
    pending_.residuals.erase(restored);
  }
  Bucket& ref = *b;
  buckets_[r.bucket_id] = std::move(b);
  return ref;
}

void CompressedReduceScatter::check_layout(const Bucket& b) {
  detail::LayoutFingerprint mine = detail::layout_fingerprint(
      config_, b.id, b.shard * comm_.world_size(), b.shard, comm_.world_size(), b.dtype);
  mine.local_world = 1;
  mine.collective = 1;
  detail::LayoutReport report{};
  report.mine = mine;
  detail::exchange_layout_report(
      comm_, backend_, report, [](int w) { return w; },
      [](const std::function<void()>& collective) { collective(); });
  detail::raise_layout_mismatch(report);
}

bool CompressedReduceScatter::reduce_scatter(const ReduceScatterRequest& r) {
  GRADCOMP_CHECK(r.input != nullptr && r.output != nullptr,
                 "reduce-scatter bucket " << r.bucket_id << " on rank " << comm_.rank()
                                          << ": null input or output");
  GRADCOMP_CHECK(r.divisor > 0.0f && std::isfinite(r.divisor),
                 "reduce-scatter bucket " << r.bucket_id << " on rank " << comm_.rank()
                                          << ": divisor must be positive and finite, got "
                                          << r.divisor);
  Bucket& b = bucket_for(r);
  if (!b.layout_checked) {
    check_layout(b);
    b.layout_checked = true;
  }
  if (device_decides_) {
    // Earlier calls' verdicts: picked up when the device has passed them; waited for only when
    // this bucket's last call is still unread (its received bytes, which name a rejected
    // sender, are about to be overwritten). A rejection raises here, before anything is queued.
    const bool repeat = std::any_of(unread_.begin(), unread_.end(),
                                    [&](const UnreadCall& c) { return c.bucket == r.bucket_id; });
    read_verdicts(repeat);
  }
  const StepRounds rounds_before = rounds_;
  const uint32_t step = rounds_.step_for(r.bucket_id);
  const int world = comm_.world_size();
  const size_t esize = dtype_size(r.dtype);
  const size_t rsize = dtype_size(config_.residual_dtype);
  const auto* input = static_cast<const uint8_t*>(r.input);
  const uint8_t code = static_cast<uint8_t>(r.dtype);

  // A non-finite input is sent as a NaN at the head of every row, so that every rank learns of it.
  // v1: the host reads the scan's flag and builds row tables with a NaN head. v2 on CUDA: the scan
  // writes the bucket's own device word and every row's encode reads it (the nan_head of
  // Q4EncodeParams and TopKEncodeParams), so nothing waits.
  const Segment whole{const_cast<uint8_t*>(input), 0, b.shard * world};
  NonfiniteScanParams scan;
  scan.segments = &whole;
  scan.num_segments = 1;
  scan.dtype = code;
  scan.numel = whole.numel;
  bool poisoned = false;
  if (device_decides_) {
    backend_.fill_zero(b.poison.get(), sizeof(uint32_t));
    scan.nonfinite = reinterpret_cast<uint32_t*>(b.poison.get());
    backend_.scan_nonfinite(scan);
  } else {
    backend_.take_decode_status();
    backend_.scan_nonfinite(scan);
    poisoned = backend_.take_decode_status();
  }

  for (int row = 0; row < world; ++row) {
    uint8_t* at = const_cast<uint8_t*>(input) + static_cast<size_t>(b.shard) * row * esize;
    Segment segments[2] = {{at, 0, b.shard}, {}};
    int num_segments = 1;
    if (poisoned) {
      segments[0] = Segment{b.nan.get(), 0, 1};
      if (b.shard > 1) segments[num_segments++] = Segment{at + esize, 1, b.shard - 1};
    }
    uint8_t* payload = b.send.get() + b.slot_bytes * row;
    const size_t roff = static_cast<size_t>(b.shard) * row * rsize;
    const bool ef = config_.error_feedback;
    if (config_.codec == Codec::kQ4) {
      math::RngKey key{config_.seed, step, static_cast<uint32_t>(b.id),
                       static_cast<uint32_t>(comm_.rank()), kFirstRowPhase + row};
      Q4EncodeParams e =
          detail::q4_encode_params(segments, num_segments, code, 0, b.shard, config_, key, payload);
      if (device_decides_) e.nan_head = reinterpret_cast<const uint32_t*>(b.poison.get());
      if (ef) {
        e.residual_in = b.residual[b.current].get() + roff;
        e.residual_out = b.residual[b.current ^ 1].get() + roff;
        e.residual_dtype = static_cast<uint8_t>(config_.residual_dtype);
      }
      backend_.q4_encode(e);
    } else {
      TopKEncodeParams e;
      e.segments = segments;
      e.num_segments = num_segments;
      e.dtype = code;
      e.numel = b.shard;
      if (ef) {
        e.residual_in = b.residual[b.current].get() + roff;
        e.residual_out = b.residual[b.current ^ 1].get() + roff;
        e.residual_dtype = static_cast<uint8_t>(config_.residual_dtype);
      }
      e.k = topk_k(b.shard, config_.topk.ratio);
      e.capacity = static_cast<uint32_t>(topk_capacity(b.shard, config_.topk));
      e.exact = config_.topk.exact;
      e.value_dtype = static_cast<uint8_t>(config_.topk.value_dtype);
      e.payload = payload;
      e.workspace = b.workspace.get();
      if (device_decides_) e.nan_head = reinterpret_cast<const uint32_t*>(b.poison.get());
      backend_.topk_encode(e);
    }
  }
  comm_.all_to_all(b.send.get(), b.recv.get(), b.slot_bytes);

  std::vector<const uint8_t*> from(world);
  for (int w = 0; w < world; ++w) from[w] = b.recv.get() + b.slot_bytes * w;
  Segment out{r.output, 0, b.shard};
  if (config_.codec == Codec::kQ4) {
    // Every payload is checked before any is decoded: a bad one leaves the output as it was.
    const std::vector<int64_t> sizes(world, b.shard);
    backend_.check_payloads(
        detail::q4_check_params(from.data(), world, b.slot_bytes, sizes.data(), config_));
    backend_.q4_decode(detail::q4_decode_params(from.data(), world, b.slot_bytes, b.shard, config_,
                                                &out, 1, code, 0, r.divisor));
  } else {
    TopKDecodeParams d;
    d.payloads = from.data();
    d.num_payloads = world;
    d.payload_bytes = b.slot_bytes;
    d.numel = b.shard;
    d.capacity = static_cast<uint32_t>(topk_capacity(b.shard, config_.topk));
    d.value_dtype = static_cast<uint8_t>(config_.topk.value_dtype);
    d.segments = &out;
    d.num_segments = 1;
    d.dtype = code;
    d.divisor = r.divisor;
    d.workspace = b.workspace.get();
    // The decode checks every payload before it writes: on the CPU it raises; on CUDA the v1 path
    // reads the verdict below and v2 leaves it in the sticky status word for end_bucket.
    backend_.topk_decode(d);
  }
  // The verdict on the payloads comes before anything advances (reduce_scatter.h's contract: a
  // rejected payload leaves output and residual as they were).
  if (device_decides_) {
    // Decided on the device: end_bucket copies the committed residual over the candidate when the
    // result is non-finite or a payload was rejected (the decode then wrote nothing), so the host
    // adopts the candidate either way; the round is counted now and taken back when a later read
    // finds the rejection (read_verdicts).
    UnreadCall call{r.bucket_id, rounds_before};
    const ResidualPair pair{b.residual[b.current ^ 1].get(), b.residual[b.current].get(),
                            b.residual[0].bytes()};
    backend_.end_bucket(&pair, config_.error_feedback ? 1 : 0);
    if (config_.error_feedback) b.current ^= 1;
    rounds_.done(r.bucket_id);
    unread_.push_back(std::move(call));
    if (snapshot_covers_ == 0) {
      uint64_t count = 0;
      backend_.poll_nonfinite_buckets(&count);  // queues the copy of the status words
      snapshot_covers_ = unread_.size();
    }
    return true;
  }
  // On CUDA (v1) this is the host wait that reads the decode's status; the candidates'
  // residual is adopted only for a finite result (the committed one stays otherwise), and the
  // round counts only once the payloads passed.
  bool nonfinite = false;
  try {
    nonfinite = backend_.take_decode_status();
  } catch (const PayloadError& e) {
    throw PayloadError(rejection_naming_rank(b, e.what()));
  }
  if (config_.error_feedback && !nonfinite) b.current ^= 1;
  if (nonfinite) ++nonfinite_buckets_;
  rounds_.done(r.bucket_id);
  return !nonfinite;
}

void CompressedReduceScatter::read_verdicts(bool wait) {
  if (unread_.empty()) return;
  uint64_t nonfinite = 0;
  size_t verified = 0;
  try {
    if (wait) {
      nonfinite = backend_.take_nonfinite_buckets();  // any queued copy first, then the rest
      verified = unread_.size();
    } else if (snapshot_covers_ > 0 && backend_.poll_nonfinite_buckets(&nonfinite)) {
      verified = snapshot_covers_;
    }
  } catch (const PayloadError& e) {
    snapshot_covers_ = 0;
    throw PayloadError(rejection_of_unread(e.what()));
  }
  if (wait || verified > 0) snapshot_covers_ = 0;
  nonfinite_buckets_ += nonfinite;
  unread_.erase(unread_.begin(), unread_.begin() + static_cast<std::ptrdiff_t>(verified));
}

std::string CompressedReduceScatter::rejection_of_unread(const std::string& device_message) {
  // The device's status word is sticky: from the rejected call on, no decode wrote and no
  // residual advanced. The first unread call whose received bytes fail the host's checks is the
  // rejected one (the device's message names the first unread call when the host finds none),
  // and the round counter goes back to before it: redoing that bucket stays in its step, as
  // after the host path's rejection.
  size_t at = 0;
  std::string named;
  for (size_t i = 0; i < unread_.size() && named.empty(); ++i) {
    named = host_rejection(*buckets_.at(unread_[i].bucket));
    if (!named.empty()) at = i;
  }
  const Bucket& b = *buckets_.at(unread_[at].bucket);
  rounds_ = unread_[at].rounds_before;
  unread_.clear();
  std::ostringstream m;
  m << "reduce-scatter bucket " << b.id << " on rank " << comm_.rank() << ": ";
  if (named.empty())
    m << device_message << " (from a rank whose header and checksum pass the host's checks)";
  else
    m << named;
  m << " (read after its call returned: that call wrote no output and advanced no residual or "
       "round, nor did the calls after it)";
  return m.str();
}

void CompressedReduceScatter::flush() {
  if (device_decides_) read_verdicts(true);
}

std::string CompressedReduceScatter::rejection_naming_rank(const Bucket& b,
                                                           const std::string& device_message) {
  std::ostringstream m;
  m << "reduce-scatter bucket " << b.id << " on rank " << comm_.rank() << ": ";
  const std::string named = host_rejection(b);
  if (named.empty())
    m << device_message << " (from a rank whose header and checksum pass the host's checks)";
  else
    m << named;
  return m.str();
}

std::string CompressedReduceScatter::host_rejection(const Bucket& b) {
  // The device only says that a payload failed: the host checks the received bytes again to name
  // the sender.
  const int world = comm_.world_size();
  std::vector<uint8_t> recv(b.slot_bytes * static_cast<size_t>(world));
  backend_.copy_to_host(recv.data(), b.recv.get(), recv.size());
  std::vector<const uint8_t*> from(static_cast<size_t>(world));
  for (int w = 0; w < world; ++w) from[static_cast<size_t>(w)] = recv.data() + b.slot_bytes * w;
  const std::vector<int64_t> sizes(static_cast<size_t>(world), b.shard);
  PayloadCheckParams check;
  if (config_.codec == Codec::kQ4) {
    check = detail::q4_check_params(from.data(), world, b.slot_bytes, sizes.data(), config_);
  } else {
    check.payloads = from.data();
    check.num_payloads = world;
    check.payload_bytes = b.slot_bytes;
    check.numel = sizes.data();
    check.codec = format::kCodecTopK;
    check.param = static_cast<uint32_t>(topk_capacity(b.shard, config_.topk));
    check.value_dtype = static_cast<uint8_t>(config_.topk.value_dtype);
  }
  try {
    make_cpu_backend(1)->check_payloads(check);
  } catch (const PayloadError& e) {
    return e.what();  // names the payload and its sending rank
  }
  return "";
}

uint32_t CompressedReduceScatter::next_step() const {
  return rounds_.next();
}

CompressionState CompressedReduceScatter::state() const {
  CompressionState s = pending_;
  s.seed = config_.seed;
  s.step = next_step();
  for (const auto& kv : buckets_) {
    const Bucket& b = *kv.second;
    if (b.residual[0].get() == nullptr) continue;
    std::vector<uint8_t> bytes(b.residual[0].bytes());
    backend_.copy_to_host(bytes.data(), b.residual[b.current].get(), bytes.size());
    s.residuals[kv.first] = std::move(bytes);
  }
  return s;
}

void CompressedReduceScatter::load_state(const CompressionState& s) {
  GRADCOMP_CHECK(s.seed == config_.seed, "checkpoint seed "
                                             << s.seed << " differs from the configured seed "
                                             << config_.seed << " on rank " << comm_.rank());
  GRADCOMP_CHECK(s.chunk_residuals.empty() && s.velocities.empty(),
                 "checkpoint on rank " << comm_.rank()
                                       << " holds allreduce state (own-chunk residuals or "
                                          "velocities), not a reduce-scatter's");
  flush();  // the calls before it are read (and a rejection among them raised) first
  rounds_.restart(s.step);
  buckets_.clear();
  pending_ = s;
}

uint64_t CompressedReduceScatter::residual_memory() const {
  uint64_t bytes = 0;
  for (const auto& kv : buckets_) bytes += kv.second->residual[0].bytes() * 2;
  return bytes;
}

int64_t CompressedReduceScatter::bucket_numel(uint64_t bucket_id) const {
  auto it = buckets_.find(bucket_id);
  return it == buckets_.end() ? -1 : it->second->shard * comm_.world_size();
}

}  // namespace gradcomp
