// The compressed all-gather: the int8 row codec on the host, one all_gather of payloads, every row
// decoded on every rank; non-finite shards refused alike on every rank.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "gradcomp/all_gather.h"
#include "gradcomp/format.h"
#include "math/int8_math.h"

namespace gradcomp {
namespace {

constexpr uint64_t kAlign = 16;

uint64_t align16(uint64_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

uint64_t blocks_of(const AllGatherRun* runs, int num_runs, int block) {
  uint64_t blocks = 0;
  for (int i = 0; i < num_runs; ++i)
    blocks += math::int8_num_blocks(static_cast<uint64_t>(runs[i].numel), block);
  return blocks;
}

uint64_t numel_of(const AllGatherRun* runs, int num_runs) {
  uint64_t n = 0;
  for (int i = 0; i < num_runs; ++i) n += static_cast<uint64_t>(runs[i].numel);
  return n;
}

void check_runs(const AllGatherRun* runs, int num_runs, int block_size) {
  GRADCOMP_CHECK(math::int8_block_size_valid(static_cast<uint32_t>(block_size)),
                 "int8 block size must be a power of two in [16, 4096], got " << block_size);
  GRADCOMP_CHECK(num_runs > 0 && runs != nullptr,
                 "an int8 row needs at least one run, got " << num_runs);
  for (int i = 0; i < num_runs; ++i) {
    GRADCOMP_CHECK(runs[i].numel > 0,
                   "run " << i << " of an int8 row has " << runs[i].numel << " elements");
    GRADCOMP_CHECK(math::dtype_valid(static_cast<uint8_t>(runs[i].dtype)),
                   "run " << i << " of an int8 row has dtype code " << int(runs[i].dtype));
  }
}

// The body checksum of the wire format v2 (docs/format.md, format::body_checksum_term), over the
// bytes after this payload's shorter header.
uint64_t body_sum(const uint8_t* payload, uint64_t total) {
  uint64_t sum = 0;
  const uint64_t words = (total - kInt8HeaderBytes) / 4;
  for (uint64_t i = 0; i < words; ++i) {
    uint32_t w;
    std::memcpy(&w, payload + kInt8HeaderBytes + 4 * i, 4);
    sum += format::body_checksum_term(w, i);
  }
  return sum;
}

void write_header(uint8_t* p, uint8_t flags, int block, int num_runs, uint64_t numel,
                  uint64_t total) {
  const uint32_t magic = kInt8PayloadMagic, b = static_cast<uint32_t>(block);
  const uint32_t runs = static_cast<uint32_t>(num_runs);
  const uint16_t version = kInt8PayloadVersion;
  std::memset(p, 0, kInt8HeaderBytes);
  std::memcpy(p, &magic, 4);
  std::memcpy(p + 4, &version, 2);
  p[6] = flags;
  std::memcpy(p + 8, &b, 4);
  std::memcpy(p + 12, &runs, 4);
  std::memcpy(p + 16, &numel, 8);
  const uint64_t sum = body_sum(p, total);
  std::memcpy(p + 24, &sum, 8);
}

}  // namespace

void Int8Options::validate() const {
  GRADCOMP_CHECK(math::int8_block_size_valid(static_cast<uint32_t>(block_size)),
                 "int8 block size must be a power of two in [16, 4096], got " << block_size);
}

uint64_t int8_payload_bytes(const AllGatherRun* runs, int num_runs, int block_size) {
  check_runs(runs, num_runs, block_size);
  return kInt8HeaderBytes + align16(2 * blocks_of(runs, num_runs, block_size)) +
         align16(numel_of(runs, num_runs));
}

uint64_t compressed_all_gather_bytes_sent(const AllGatherRun* runs, int num_runs, int block_size,
                                          int world) {
  return static_cast<uint64_t>(world - 1) * int8_payload_bytes(runs, num_runs, block_size);
}

uint64_t all_gather_row_bytes(const AllGatherRun* runs, int num_runs) {
  uint64_t bytes = 0;
  for (int i = 0; i < num_runs; ++i)
    bytes += static_cast<uint64_t>(runs[i].numel) * dtype_size(runs[i].dtype);
  return bytes;
}

bool int8_encode_row(const void* input, const AllGatherRun* runs, int num_runs, int block_size,
                     uint8_t* payload) {
  const uint64_t total = int8_payload_bytes(runs, num_runs, block_size);
  const uint64_t blocks = blocks_of(runs, num_runs, block_size);
  uint8_t* scales = payload + kInt8HeaderBytes;
  int8_t* codes = reinterpret_cast<int8_t*>(scales + align16(2 * blocks));
  std::memset(payload, 0, total);
  const auto* at = static_cast<const uint8_t*>(input);
  uint64_t block_index = 0, out = 0;
  bool finite = true;
  for (int r = 0; r < num_runs; ++r) {
    const uint8_t dt = static_cast<uint8_t>(runs[r].dtype);
    for (int64_t start = 0; start < runs[r].numel; start += block_size) {
      const int64_t end = std::min<int64_t>(start + block_size, runs[r].numel);
      float absmax = 0.0f;
      bool block_finite = true;
      for (int64_t i = start; i < end; ++i) {
        const float a = std::fabs(math::load_as_float(at, i, dt));
        block_finite = block_finite && std::isfinite(a);
        absmax = a > absmax ? a : absmax;
      }
      finite = finite && block_finite;
      if (!block_finite) continue;  // the payload is flagged below; its codes are never sent
      const uint16_t sbits = math::int8_scale_bits(absmax);
      std::memcpy(scales + 2 * block_index++, &sbits, 2);
      const float scale = math::bf16_to_float(sbits);
      for (int64_t i = start; i < end; ++i)
        codes[out++] =
            static_cast<int8_t>(math::int8_quantize(math::load_as_float(at, i, dt), scale));
    }
    at += runs[r].numel * dtype_size(runs[r].dtype);
  }
  if (!finite) {
    // A NaN weight never reaches the wire as numbers: the flagged payload carries no body.
    std::memset(payload, 0, total);
    write_header(payload, kInt8FlagNonfinite, block_size, num_runs, numel_of(runs, num_runs),
                 total);
    return false;
  }
  write_header(payload, 0, block_size, num_runs, numel_of(runs, num_runs), total);
  return true;
}

bool int8_check_row(const uint8_t* p, const AllGatherRun* runs, int num_runs, int block_size,
                    int from_rank) {
  const uint64_t total = int8_payload_bytes(runs, num_runs, block_size);
  uint32_t magic, block, nruns;
  uint16_t version;
  uint64_t numel, sum;
  std::memcpy(&magic, p, 4);
  std::memcpy(&version, p + 4, 2);
  std::memcpy(&block, p + 8, 4);
  std::memcpy(&nruns, p + 12, 4);
  std::memcpy(&numel, p + 16, 8);
  std::memcpy(&sum, p + 24, 8);
  std::ostringstream why;
  if (magic != kInt8PayloadMagic) {
    why << "is not an int8 all-gather payload (magic " << std::hex << magic << ")";
  } else if (version != kInt8PayloadVersion) {
    why << "has format version " << version << ", this build reads " << kInt8PayloadVersion;
  } else if (block != static_cast<uint32_t>(block_size) ||
             nruns != static_cast<uint32_t>(num_runs) || numel != numel_of(runs, num_runs)) {
    why << "holds " << numel << " elements in " << nruns << " runs of blocks of " << block
        << ", this rank expects " << numel_of(runs, num_runs) << " in " << num_runs
        << " runs of blocks of " << block_size;
  } else if ((p[6] & ~kInt8FlagNonfinite) != 0) {
    why << "has unknown flags " << int(p[6]);
  } else if (sum != body_sum(p, total)) {
    why << "fails its body checksum (corrupted in transit?)";
  }
  const std::string problem = why.str();
  if (!problem.empty()) {
    std::ostringstream m;
    m << "int8 all-gather payload from rank " << from_rank << " " << problem;
    throw PayloadError(m.str());
  }
  return (p[6] & kInt8FlagNonfinite) == 0;
}

void int8_decode_row(const uint8_t* payload, const AllGatherRun* runs, int num_runs, int block_size,
                     void* output) {
  const uint64_t blocks = blocks_of(runs, num_runs, block_size);
  const uint8_t* scales = payload + kInt8HeaderBytes;
  const int8_t* codes = reinterpret_cast<const int8_t*>(scales + align16(2 * blocks));
  auto* at = static_cast<uint8_t*>(output);
  uint64_t block_index = 0, in = 0;
  for (int r = 0; r < num_runs; ++r) {
    const uint8_t dt = static_cast<uint8_t>(runs[r].dtype);
    for (int64_t start = 0; start < runs[r].numel; start += block_size) {
      const int64_t end = std::min<int64_t>(start + block_size, runs[r].numel);
      uint16_t sbits;
      std::memcpy(&sbits, scales + 2 * block_index++, 2);
      const float scale = math::bf16_to_float(sbits);
      for (int64_t i = start; i < end; ++i)
        math::store_from_float(at, i, dt, math::int8_dequantize(codes[in++], scale));
    }
    at += runs[r].numel * dtype_size(runs[r].dtype);
  }
}

CompressedAllGather::CompressedAllGather(Communicator& comm, Backend& backend,
                                         const Int8Options& options)
    : comm_(comm), options_(options) {
  options_.validate();
  GRADCOMP_CHECK(!backend.is_cuda() && !comm.device_memory(),
                 "the int8 all-gather runs on the CPU only: its CUDA path has not been written "
                 "or run on a GPU yet, so it is refused rather than offered untested (keep the "
                 "weights' all-gather uncompressed on CUDA)");
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
  const uint64_t mine[4] = {numel_of(r.runs, r.num_runs), static_cast<uint64_t>(r.num_runs),
                            static_cast<uint64_t>(options_.block_size), runs_hash};
  const int world = comm_.world_size();
  std::vector<uint64_t> all(4 * static_cast<size_t>(world));
  comm_.all_gather(mine, all.data(), sizeof mine);
  bool agree = true;
  for (int w = 0; w < world; ++w) agree = agree && std::equal(mine, mine + 4, all.data() + 4 * w);
  if (!agree) {
    // Every rank lists every rank's layout, so each raises the same picture of the mismatch.
    std::ostringstream m;
    m << "all-gather of " << r.name << " (bucket " << r.bucket_id << ") refused on rank "
      << comm_.rank() << ": the ranks' layouts differ (";
    for (int w = 0; w < world; ++w) {
      m << (w ? "; " : "") << "rank " << w << ": " << all[4 * w] << " elements in "
        << all[4 * w + 1] << " runs, blocks of " << all[4 * w + 2];
    }
    m << ")";
    GRADCOMP_CHECK(false, m.str());
  }
  checked_.insert(r.bucket_id);
}

void CompressedAllGather::all_gather(const AllGatherRequest& r) {
  const int rank = comm_.rank(), world = comm_.world_size();
  GRADCOMP_CHECK(r.input != nullptr && r.output != nullptr,
                 "all-gather of " << r.name << " (bucket " << r.bucket_id << ") on rank " << rank
                                  << ": null input or output");
  const uint64_t slot = int8_payload_bytes(r.runs, r.num_runs, options_.block_size);
  if (checked_.count(r.bucket_id) == 0) check_layout(r);
  const uint64_t row_bytes = all_gather_row_bytes(r.runs, r.num_runs);
  if (send_.size() < slot) send_.resize(slot);
  if (recv_.size() < slot * world) recv_.resize(slot * world);

  auto start = std::chrono::steady_clock::now();
  int8_encode_row(r.input, r.runs, r.num_runs, options_.block_size, send_.data());
  codec_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  comm_.all_gather(send_.data(), recv_.data(), slot);

  start = std::chrono::steady_clock::now();
  // Every payload passes before any row is written; a flagged one stops every rank alike (each
  // received the same flags), naming every rank whose shard is not finite.
  std::vector<int> nonfinite;
  for (int w = 0; w < world; ++w) {
    try {
      if (!int8_check_row(recv_.data() + slot * w, r.runs, r.num_runs, options_.block_size, w))
        nonfinite.push_back(w);
    } catch (const PayloadError& e) {
      std::ostringstream m;
      m << "all-gather of " << r.name << " (bucket " << r.bucket_id << ") on rank " << rank << ": "
        << e.what();
      throw PayloadError(m.str());
    }
  }
  if (!nonfinite.empty()) {
    std::ostringstream ranks;
    for (size_t i = 0; i < nonfinite.size(); ++i) ranks << (i ? ", " : "") << nonfinite[i];
    GRADCOMP_CHECK(false, "int8 all-gather of " << r.name << " (bucket " << r.bucket_id
                                                << ") refused on rank " << rank
                                                << ": the weight shards of rank(s) " << ranks.str()
                                                << " hold NaN or infinity, which are not "
                                                   "quantized (did the optimizer step diverge?)");
  }
  auto* out = static_cast<uint8_t*>(r.output);
  for (int w = 0; w < world; ++w)
    int8_decode_row(recv_.data() + slot * w, r.runs, r.num_runs, options_.block_size,
                    out + row_bytes * w);
  codec_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace gradcomp
