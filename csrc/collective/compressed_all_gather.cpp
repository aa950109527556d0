// The compressed all-gather: every rank's shard encoded as int8 by the backend, one all_gather of
// payloads, every row checked and decoded on every rank; non-finite shards refused alike on
// every rank.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "backend_buffer.h"
#include "gradcomp/all_gather.h"
#include "gradcomp/cpu.h"

namespace gradcomp {
namespace {

std::vector<Int8Run> to_int8_runs(const AllGatherRun* runs, int num_runs) {
  std::vector<Int8Run> out(num_runs > 0 ? num_runs : 0);
  for (int i = 0; i < num_runs; ++i) {
    out[i].dtype = static_cast<uint8_t>(runs[i].dtype);
    out[i].numel = runs[i].numel;
  }
  return out;
}

void check_runs(const Int8Run* runs, int num_runs, uint32_t block, const char* what) {
  const char* problem = int8_runs_problem(runs, num_runs, block);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (block size " << block << ", "
                                          << num_runs << " runs)");
}

}  // namespace

const char* int8_verdict_text(int32_t verdict) {
  switch (verdict) {
    case kInt8Ok:
      return "is well-formed";
    case kInt8Nonfinite:
      return "is flagged: the shard held NaN or infinity";
    case kInt8BadMagic:
      return "is not an int8 all-gather payload (its magic is not GCW8)";
    case kInt8BadVersion:
      return "has another format version than this build reads";
    case kInt8BadLayout:
      return "holds another block size, run count or element count than this rank expects";
    case kInt8BadFlags:
      return "has unknown flags or a nonzero reserved header byte";
    case kInt8BadChecksum:
      return "fails its body checksum (corrupted in transit?)";
    default:
      return "has an unknown verdict";
  }
}

uint64_t int8_payload_bytes(const AllGatherRun* runs, int num_runs, int block_size) {
  const std::vector<Int8Run> r = to_int8_runs(runs, num_runs);
  check_runs(r.data(), num_runs, static_cast<uint32_t>(block_size), "an int8 row");
  return int8_row_payload_bytes(r.data(), num_runs, static_cast<uint32_t>(block_size));
}

uint64_t compressed_all_gather_bytes_sent(const AllGatherRun* runs, int num_runs, int block_size,
                                          int world) {
  return static_cast<uint64_t>(world - 1) * int8_payload_bytes(runs, num_runs, block_size);
}

uint64_t all_gather_row_bytes(const AllGatherRun* runs, int num_runs) {
  const std::vector<Int8Run> r = to_int8_runs(runs, num_runs);
  return int8_row_bytes(r.data(), num_runs);
}

bool int8_encode_row(const void* input, const AllGatherRun* runs, int num_runs, int block_size,
                     uint8_t* payload) {
  const std::vector<Int8Run> r = to_int8_runs(runs, num_runs);
  check_runs(r.data(), num_runs, static_cast<uint32_t>(block_size), "int8 encode");
  return cpu::int8_encode_row(input, r.data(), num_runs, static_cast<uint32_t>(block_size),
                              payload) == 0;
}

bool int8_check_row(const uint8_t* payload, const AllGatherRun* runs, int num_runs, int block_size,
                    int from_rank) {
  const std::vector<Int8Run> r = to_int8_runs(runs, num_runs);
  check_runs(r.data(), num_runs, static_cast<uint32_t>(block_size), "int8 payload check");
  const Int8Verdict v =
      cpu::int8_row_verdict(payload, r.data(), num_runs, static_cast<uint32_t>(block_size));
  if (v != kInt8Ok && v != kInt8Nonfinite) {
    std::ostringstream m;
    m << "int8 all-gather payload from rank " << from_rank << " " << int8_verdict_text(v);
    throw PayloadError(m.str());
  }
  return v == kInt8Ok;
}

void int8_decode_row(const uint8_t* payload, const AllGatherRun* runs, int num_runs, int block_size,
                     void* output) {
  const std::vector<Int8Run> r = to_int8_runs(runs, num_runs);
  check_runs(r.data(), num_runs, static_cast<uint32_t>(block_size), "int8 decode");
  cpu::int8_decode_row(payload, r.data(), num_runs, static_cast<uint32_t>(block_size), output);
}

namespace {

const char* codec_name(WeightCodec codec) {
  return codec == WeightCodec::kInt4 ? "4-bit" : "int8";
}

const char* verdict_text(WeightCodec codec, int32_t verdict) {
  if (codec == WeightCodec::kInt4 && verdict == kInt8BadMagic)
    return "is not a 4-bit all-gather payload (its magic is not GCW4)";
  return int8_verdict_text(verdict);
}

}  // namespace

struct CompressedAllGather::Buffers {
  detail::BackendBuffer send, recv;  // this rank's payload; every rank's
  detail::BackendBuffer status;      // Int8EncodeParams::nonfinite_at, then the verdict words
};

void AllGatherOptions::validate() const {
  GRADCOMP_CHECK(math::int8_block_size_valid(static_cast<uint32_t>(block_size)),
                 codec_name(codec)
                     << " block size must be a power of two in [16, 4096], got " << block_size);
  GRADCOMP_CHECK(codec == WeightCodec::kInt8 || codec == WeightCodec::kInt4,
                 "unknown weight codec " << static_cast<int>(codec));
}

CompressedAllGather::CompressedAllGather(Communicator& comm, Backend& backend,
                                         const AllGatherOptions& options)
    : comm_(comm), backend_(backend), options_(options), buffers_(std::make_unique<Buffers>()) {
  options_.validate();
  const char* name = codec_name(options_.codec);
  GRADCOMP_CHECK(comm.device_memory() == backend.is_cuda(),
                 "the " << name
                        << " all-gather's communicator and backend disagree on host versus device "
                           "memory");
  const char* unsupported = options_.codec == WeightCodec::kInt4 ? backend.int4_unsupported()
                                                                 : backend.int8_unsupported();
  GRADCOMP_CHECK(unsupported == nullptr,
                 "the " << name << " all-gather cannot run here: " << unsupported);
}

uint64_t CompressedAllGather::payload_bytes(const AllGatherRun* runs, int num_runs) const {
  if (options_.codec == WeightCodec::kInt8)
    return int8_payload_bytes(runs, num_runs, options_.block_size);
  const std::vector<Int8Run> r = to_int8_runs(runs, num_runs);
  check_runs(r.data(), num_runs, static_cast<uint32_t>(options_.block_size), "a 4-bit row");
  return int4_row_payload_bytes(r.data(), num_runs, static_cast<uint32_t>(options_.block_size));
}

CompressedAllGather::~CompressedAllGather() = default;

void CompressedAllGather::check_layout(const AllGatherRequest& r) {
  // FNV-1a over the runs, so that rows of equal size but other dtypes or boundaries differ too.
  uint64_t runs_hash = 1469598103934665603ull;
  for (int i = 0; i < r.num_runs; ++i) {
    for (uint64_t v : {static_cast<uint64_t>(r.runs[i].dtype), uint64_t(r.runs[i].numel)}) {
      runs_hash = (runs_hash ^ v) * 1099511628211ull;
    }
  }
  // The codec rides above the block size, so ranks of other codecs are refused like other blocks.
  const uint64_t codec_and_block =
      (static_cast<uint64_t>(options_.codec) << 32) | static_cast<uint64_t>(options_.block_size);
  const uint64_t mine[4] = {int8_row_numel(runs_.data(), r.num_runs),
                            static_cast<uint64_t>(r.num_runs), codec_and_block, runs_hash};
  const int world = comm_.world_size();
  std::vector<uint64_t> all(4 * static_cast<size_t>(world));
  {
    // Through the backend's memory, which is what the communicator moves.
    detail::BackendBuffer send(backend_, sizeof mine), recv(backend_, sizeof mine * world);
    backend_.copy_from_host(send.get(), mine, sizeof mine);
    comm_.all_gather(send.get(), recv.get(), sizeof mine);
    backend_.copy_to_host(all.data(), recv.get(), sizeof mine * world);
  }
  bool agree = true;
  for (int w = 0; w < world; ++w) agree = agree && std::equal(mine, mine + 4, all.data() + 4 * w);
  if (!agree) {
    // Every rank lists every rank's layout, so each raises the same picture of the mismatch.
    std::ostringstream m;
    m << "all-gather of " << r.name << " (bucket " << r.bucket_id << ") refused on rank "
      << comm_.rank() << ": the ranks' layouts differ (";
    for (int w = 0; w < world; ++w) {
      m << (w ? "; " : "") << "rank " << w << ": " << all[4 * w] << " elements in "
        << all[4 * w + 1] << " runs, " << codec_name(static_cast<WeightCodec>(all[4 * w + 2] >> 32))
        << " blocks of " << (all[4 * w + 2] & 0xFFFFFFFFu);
    }
    m << ")";
    GRADCOMP_CHECK(false, m.str());
  }
  checked_.insert(r.bucket_id);
}

void CompressedAllGather::reserve(uint64_t slot, int world) {
  Buffers& b = *buffers_;
  if (b.send.bytes() < slot) b.send = detail::BackendBuffer(backend_, slot);
  if (b.recv.bytes() < slot * world) b.recv = detail::BackendBuffer(backend_, slot * world);
  const uint64_t status_bytes = sizeof(uint64_t) + sizeof(int32_t) * (world + 1);
  if (b.status.bytes() < status_bytes) b.status = detail::BackendBuffer(backend_, status_bytes);
}

void CompressedAllGather::all_gather(const AllGatherRequest& r) {
  const int rank = comm_.rank(), world = comm_.world_size();
  GRADCOMP_CHECK(r.input != nullptr && r.output != nullptr,
                 "all-gather of " << r.name << " (bucket " << r.bucket_id << ") on rank " << rank
                                  << ": null input or output");
  const uint64_t slot = payload_bytes(r.runs, r.num_runs);
  const bool int4 = options_.codec == WeightCodec::kInt4;
  runs_.resize(r.num_runs);
  for (int i = 0; i < r.num_runs; ++i) {
    runs_[i].dtype = static_cast<uint8_t>(r.runs[i].dtype);
    runs_[i].numel = r.runs[i].numel;
  }
  if (checked_.count(r.bucket_id) == 0) check_layout(r);
  const uint64_t row_bytes = int8_row_bytes(runs_.data(), r.num_runs);
  reserve(slot, world);
  auto* nonfinite_at = reinterpret_cast<uint64_t*>(buffers_->status.get());
  auto* verdicts = reinterpret_cast<int32_t*>(buffers_->status.get() + sizeof(uint64_t));

  auto start = std::chrono::steady_clock::now();
  Int8EncodeParams e;
  e.input = r.input;
  e.runs = runs_.data();
  e.num_runs = r.num_runs;
  e.block_size = static_cast<uint32_t>(options_.block_size);
  e.payload = buffers_->send.get();
  e.payload_bytes = slot;
  e.nonfinite_at = nonfinite_at;
  if (int4)
    backend_.int4_encode(e);
  else
    backend_.int8_encode(e);
  codec_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  comm_.all_gather(buffers_->send.get(), buffers_->recv.get(), slot);

  start = std::chrono::steady_clock::now();
  // The backend checks every payload before it writes any row (a rank's own `input` may be its
  // output row), and leaves its verdicts in the status words.
  std::vector<const uint8_t*> payloads(world);
  for (int w = 0; w < world; ++w)
    payloads[w] = buffers_->recv.get() + slot * static_cast<uint64_t>(w);
  Int8DecodeParams d;
  d.payloads = payloads.data();
  d.num_payloads = world;
  d.payload_bytes = slot;
  d.runs = runs_.data();
  d.num_runs = r.num_runs;
  d.block_size = e.block_size;
  d.output = r.output;
  d.output_bytes = row_bytes * static_cast<uint64_t>(world);
  d.verdicts = verdicts;
  if (int4)
    backend_.int4_decode(d);
  else
    backend_.int8_decode(d);
  // The call's one read of the device (on CUDA its only wait): the report words.
  std::vector<uint8_t> status(sizeof(uint64_t) + sizeof(int32_t) * (world + 1));
  backend_.copy_to_host(status.data(), buffers_->status.get(), status.size());
  codec_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  raise_verdicts(r, status);
}

void CompressedAllGather::raise_verdicts(const AllGatherRequest& r,
                                         const std::vector<uint8_t>& status) const {
  const int rank = comm_.rank(), world = comm_.world_size();
  uint64_t nonfinite_at;
  std::memcpy(&nonfinite_at, status.data(), sizeof nonfinite_at);
  std::vector<int32_t> verdicts(world + 1);
  std::memcpy(verdicts.data(), status.data() + sizeof(uint64_t), sizeof(int32_t) * (world + 1));
  if (verdicts[world] == 0) return;
  // A bad payload stops every rank alike (each received the same bytes), naming its rank.
  for (int w = 0; w < world; ++w) {
    if (verdicts[w] == kInt8Ok || verdicts[w] == kInt8Nonfinite) continue;
    std::ostringstream m;
    m << "all-gather of " << r.name << " (bucket " << r.bucket_id << ") on rank " << rank << ": "
      << codec_name(options_.codec) << " all-gather payload from rank " << w << " "
      << verdict_text(options_.codec, verdicts[w]);
    throw PayloadError(m.str());
  }
  // Flagged payloads likewise, naming every rank whose shard is not finite.
  std::ostringstream ranks;
  int listed = 0;
  for (int w = 0; w < world; ++w)
    if (verdicts[w] == kInt8Nonfinite) ranks << (listed++ ? ", " : "") << w;
  std::ostringstream where;
  if (nonfinite_at != 0) {
    // Where in this rank's own shard: the run and the element within it.
    uint64_t offset = nonfinite_at - 1;
    int run = 0;
    while (run + 1 < static_cast<int>(runs_.size()) &&
           offset >= static_cast<uint64_t>(runs_[run].numel)) {
      offset -= static_cast<uint64_t>(runs_[run].numel);
      ++run;
    }
    where << "; this rank's first is element " << offset << " of run " << run << " ("
          << dtype_name(static_cast<DType>(runs_[run].dtype)) << ", element " << nonfinite_at - 1
          << " of its shard)";
  }
  GRADCOMP_CHECK(false, codec_name(options_.codec)
                            << " all-gather of " << r.name << " (bucket " << r.bucket_id
                            << ") refused on rank " << rank << ": the weight shards of rank(s) "
                            << ranks.str()
                            << " hold NaN or infinity, which are not "
                               "quantized (did the optimizer step diverge?)"
                            << where.str());
}

}  // namespace gradcomp
