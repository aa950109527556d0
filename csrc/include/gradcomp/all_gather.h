// The compressed all-gather: every rank's shard as block-scaled int8, every row decoded on every
// rank (FSDP's parameter all-gather, ZeRO++'s qwZ; docs/api.md, docs/format.md).
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gradcomp/backend.h"
#include "gradcomp/communicator.h"
#include "gradcomp/types.h"

namespace gradcomp {

// The weight codecs: block-scaled int8 (GCW8) and 4-bit (GCW4), both round to nearest with one
// bf16 scale per block (docs/format.md).
enum class WeightCodec : uint8_t { kInt8 = 0, kInt4 = 1 };

// The compressed all-gather's options: the codec and its block size.
struct AllGatherOptions {
  int block_size = 64;  // math::int8_block_size_valid (4-bit: the same rule); one scale per block
  WeightCodec codec = WeightCodec::kInt8;
  void validate() const;
};
// The name these options had while int8 was the only weight codec.
using Int8Options [[deprecated("use gradcomp::AllGatherOptions")]] = AllGatherOptions;

// A stretch of a row holding elements of one dtype. FSDP's all-gather rows are the parameters'
// shards back to back; with parameters of several dtypes FSDP sends them as bytes, and each
// stretch of one dtype is quantized on its own (blocks restart at the head of every run).
struct AllGatherRun {
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
};

// One all-gather. Every rank's row has the same runs; row r of the output receives rank r's
// shard decoded, this rank's own row included (so every rank computes with the same weights).
// `input` may be the output's row rank() (FSDP passes it so): it is read before any row is
// written.
struct AllGatherRequest {
  const void* input = nullptr;  // this rank's row: the runs' elements back to back
  void* output = nullptr;       // world_size rows of the same bytes as the input
  const AllGatherRun* runs = nullptr;
  int num_runs = 0;
  uint64_t bucket_id = 0;
  std::string name;  // what errors call the bucket (FSDP: the module's name)
};

// The wire format of one row (kInt8PayloadMagic and the rest) is in int8_params.h.

// Bytes of a row's payload: header, one bf16 scale per block of every run, one code per element,
// each section padded to 16 bytes.
uint64_t int8_payload_bytes(const AllGatherRun* runs, int num_runs, int block_size);
// Bytes one rank sends in one compressed all-gather: its payload to each other rank.
uint64_t compressed_all_gather_bytes_sent(const AllGatherRun* runs, int num_runs, int block_size,
                                          int world);
// Bytes of a row as elements of the runs' dtypes (what an uncompressed all-gather sends per rank).
uint64_t all_gather_row_bytes(const AllGatherRun* runs, int num_runs);

// The reference codec, on host memory. Encode never quantizes a non-finite element: it writes a
// payload flagged kInt8FlagNonfinite with zero sections and returns false.
bool int8_encode_row(const void* input, const AllGatherRun* runs, int num_runs, int block_size,
                     uint8_t* payload);
// Checks a payload's header and body checksum against the runs; returns false for a payload
// flagged non-finite. Throws PayloadError for foreign or corrupted bytes (naming `from_rank`).
bool int8_check_row(const uint8_t* payload, const AllGatherRun* runs, int num_runs, int block_size,
                    int from_rank);
void int8_decode_row(const uint8_t* payload, const AllGatherRun* runs, int num_runs, int block_size,
                     void* output);
// What a payload with this Int8Verdict is, for messages ("fails its body checksum ...").
const char* int8_verdict_text(int32_t verdict);

// All-gathers shards as int8 (or, with AllGatherOptions::codec kInt4, 4-bit) payloads through the
// communicator's all_gather. No state across
// calls besides buffers per bucket; deterministic (round to nearest), so the same shards give the
// same bytes on every call (FSDP's forward and backward all-gathers agree).
//
// Non-finite weights: a rank whose shard holds NaN or infinity sends a flagged payload; every rank
// then raises the same Error naming the bucket and every such rank, before writing any row, so no
// rank hangs and none computes with a silently quantized NaN.
//
// Layouts: at a bucket's first call the ranks exchange its layout (elements, runs, block size;
// 32 bytes each) and raise naming the ranks that differ, rather than all-gathering payloads of
// different sizes (which a transport may hang on).
//
// Backends: the CPU backend (host memory), and the CUDA backend with the v2 kernels
// (GRADCOMP_KERNELS=v2; under v1 construction is refused naming it). On CUDA nothing waits for
// the device but one small read of the verdict words at the end of the call (docs/fsdp2-notes.md).
class CompressedAllGather {
 public:
  CompressedAllGather(Communicator& comm, Backend& backend, const AllGatherOptions& options);
  ~CompressedAllGather();
  CompressedAllGather(const CompressedAllGather&) = delete;
  CompressedAllGather& operator=(const CompressedAllGather&) = delete;

  void all_gather(const AllGatherRequest& request);

  const AllGatherOptions& options() const { return options_; }
  // Bytes of one rank's payload for a row of these runs in this all-gather's codec.
  uint64_t payload_bytes(const AllGatherRun* runs, int num_runs) const;
  int world_size() const { return comm_.world_size(); }
  // Seconds spent encoding, checking and decoding since construction.
  double codec_seconds() const { return codec_seconds_; }

 private:
  struct Buffers;
  void check_layout(const AllGatherRequest& request);
  void reserve(uint64_t slot, int world);
  // Throws the Error (or PayloadError) the verdict words read back from the backend call for.
  void raise_verdicts(const AllGatherRequest& request, const std::vector<uint8_t>& status) const;

  Communicator& comm_;
  Backend& backend_;
  AllGatherOptions options_;
  std::unique_ptr<Buffers> buffers_;  // the backend's memory, reused: the largest row so far
  std::vector<Int8Run> runs_;         // the current request's runs as dtype codes
  std::set<uint64_t> checked_;        // buckets whose layout the ranks agreed on
  double codec_seconds_ = 0.0;
};

}  // namespace gradcomp
