// The compressed all-gather with in-process ranks: every rank's output equals every shard's own
// encode and decode, uneven and mixed-dtype rows, non-finite shards refused on every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/all_gather.h"
#include "gradcomp/cpu.h"
#include "gradcomp/inprocess_group.h"
#include "run_ranks.h"

namespace gradcomp {
namespace {

using testing::run_ranks;

// Rank w's row: random floats of each run's dtype (bf16 runs hold the fp32 values' top halves).
std::vector<uint8_t> shard_of(int w, const std::vector<AllGatherRun>& runs) {
  std::mt19937 rng(100 + w);
  std::normal_distribution<float> n(0.0f, 0.02f);
  std::vector<uint8_t> bytes(all_gather_row_bytes(runs.data(), static_cast<int>(runs.size())));
  uint8_t* at = bytes.data();
  for (const auto& r : runs) {
    for (int64_t i = 0; i < r.numel; ++i) {
      const float v = n(rng) * (i % 97 == 5 ? 40.0f : 1.0f);  // outliers: blocks of other scales
      if (r.dtype == DType::kFloat32) {
        std::memcpy(at + 4 * i, &v, 4);
      } else {
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        const uint16_t top = static_cast<uint16_t>(bits >> 16);
        std::memcpy(at + 2 * i, &top, 2);
      }
    }
    at += r.numel * dtype_size(r.dtype);
  }
  return bytes;
}

// Every rank's row through the codec's own row functions (GCW4's: the CPU reference, whose bytes
// tests/codec/test_int4.cpp pins by hand).
std::vector<uint8_t> reference(int world, const std::vector<AllGatherRun>& runs, int block,
                               WeightCodec codec) {
  const int n = static_cast<int>(runs.size());
  const uint64_t row = all_gather_row_bytes(runs.data(), n);
  std::vector<uint8_t> out(row * world);
  std::vector<Int8Run> r4(runs.size());
  for (size_t i = 0; i < runs.size(); ++i)
    r4[i] = Int8Run{static_cast<uint8_t>(runs[i].dtype), runs[i].numel};
  const uint32_t b = static_cast<uint32_t>(block);
  std::vector<uint8_t> payload(codec == WeightCodec::kInt4
                                   ? int4_row_payload_bytes(r4.data(), n, b)
                                   : int8_payload_bytes(runs.data(), n, block));
  for (int w = 0; w < world; ++w) {
    if (codec == WeightCodec::kInt4) {
      EXPECT_EQ(cpu::int4_encode_row(shard_of(w, runs).data(), r4.data(), n, b, payload.data()),
                0u);
      cpu::int4_decode_row(payload.data(), r4.data(), n, b, out.data() + row * w);
      continue;
    }
    EXPECT_TRUE(int8_encode_row(shard_of(w, runs).data(), runs.data(), n, block, payload.data()));
    int8_decode_row(payload.data(), runs.data(), n, block, out.data() + row * w);
  }
  return out;
}

void gather_and_compare(int world, const std::vector<AllGatherRun>& runs, int block,
                        WeightCodec codec = WeightCodec::kInt8) {
  const int n = static_cast<int>(runs.size());
  const uint64_t row = all_gather_row_bytes(runs.data(), n);
  const std::vector<uint8_t> expected = reference(world, runs, block, codec);
  InProcessGroup group(world);
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    AllGatherOptions o;
    o.block_size = block;
    o.codec = codec;
    CompressedAllGather ag(comm, *backend, o);
    std::vector<uint8_t> out(row * world, 0xEE);
    const std::vector<uint8_t> mine = shard_of(rank, runs);
    std::memcpy(out.data() + row * rank, mine.data(),
                row);  // FSDP: the input is a row of the output
    AllGatherRequest r;
    r.input = out.data() + row * rank;
    r.output = out.data();
    r.runs = runs.data();
    r.num_runs = n;
    r.name = "layer";
    uint64_t before = comm.bytes_sent();
    for (int call = 0; call < 2; ++call) {  // the same shards give the same bytes again
      if (call == 1) std::memcpy(out.data() + row * rank, mine.data(), row);
      ag.all_gather(r);
      EXPECT_EQ(out, expected) << "rank " << rank << " call " << call;
      // The first call also agrees on the layout: 32 bytes to each other rank.
      EXPECT_EQ(comm.bytes_sent() - before, (world - 1) * ag.payload_bytes(runs.data(), n) +
                                                (call == 0 ? 32u * (world - 1) : 0u));
      if (codec == WeightCodec::kInt8)
        EXPECT_EQ(ag.payload_bytes(runs.data(), n), int8_payload_bytes(runs.data(), n, block));
      before = comm.bytes_sent();
    }
  });
}

TEST(CompressedAllGather, EveryRankDecodesEveryRowAsTheReference) {
  for (int world : {2, 3, 4}) {
    gather_and_compare(world, {{DType::kFloat32, 1000}}, 64);
    gather_and_compare(world, {{DType::kBFloat16, 77}}, 64);  // one short block
    gather_and_compare(world, {{DType::kFloat32, 5}}, 16);    // smaller than a block
  }
}

TEST(CompressedAllGather, RowsOfSeveralDtypesRestartBlocksAtEachRun) {
  gather_and_compare(3, {{DType::kFloat32, 70}, {DType::kBFloat16, 33}, {DType::kFloat16, 129}},
                     32);
}

TEST(CompressedAllGather, BytesAreAboutEightBitsPerElementPlusTheScales) {
  const AllGatherRun run{DType::kFloat32, 1 << 20};
  EXPECT_EQ(int8_payload_bytes(&run, 1, 64), 32u + 2u * (1u << 14) + (1u << 20));
  EXPECT_EQ(compressed_all_gather_bytes_sent(&run, 1, 64, 4), 3 * int8_payload_bytes(&run, 1, 64));
  EXPECT_EQ(all_gather_row_bytes(&run, 1), 4u << 20);
}

TEST(CompressedAllGather, ANonFiniteShardIsRefusedOnEveryRankNamingTheRank) {
  const int world = 3;
  const std::vector<AllGatherRun> runs = {{DType::kFloat32, 100}};
  const uint64_t row = all_gather_row_bytes(runs.data(), 1);
  InProcessGroup group(world);
  std::vector<std::string> errors;
  run_ranks(
      group,
      [&](int rank, Communicator& comm) {
        auto backend = make_cpu_backend();
        CompressedAllGather ag(comm, *backend, AllGatherOptions{});
        std::vector<uint8_t> out(row * world, 0);
        std::vector<uint8_t> mine = shard_of(rank, runs);
        if (rank == 1) {
          const float nan = NAN;
          std::memcpy(mine.data() + 4 * 42, &nan, 4);
        }
        std::memcpy(out.data() + row * rank, mine.data(), row);
        AllGatherRequest r;
        r.input = out.data() + row * rank;
        r.output = out.data();
        r.runs = runs.data();
        r.num_runs = 1;
        r.bucket_id = 7;
        r.name = "blocks.3";
        ag.all_gather(r);
      },
      &errors);
  ASSERT_EQ(errors.size(), static_cast<size_t>(world));
  for (const auto& e : errors) {
    EXPECT_NE(e.find("blocks.3 (bucket 7)"), std::string::npos) << e;
    EXPECT_NE(e.find("rank(s) 1 hold NaN or infinity"), std::string::npos) << e;
  }
  // Rank 1 also says where in its own shard (errors arrive in rank order).
  EXPECT_NE(errors[1].find("this rank's first is element 42 of run 0 (float32"), std::string::npos)
      << errors[1];
  EXPECT_EQ(errors[0].find("this rank's first"), std::string::npos) << errors[0];
}

TEST(CompressedAllGather, RanksWithOtherLayoutsAreNamedInsteadOfHanging) {
  const int world = 3;
  InProcessGroup group(world);
  std::vector<std::string> errors;
  run_ranks(
      group,
      [&](int rank, Communicator& comm) {
        auto backend = make_cpu_backend();
        CompressedAllGather ag(comm, *backend, AllGatherOptions{});
        const std::vector<AllGatherRun> runs = {{DType::kFloat32, rank == 2 ? 65 : 64}};
        std::vector<uint8_t> out(all_gather_row_bytes(runs.data(), 1) * world, 0);
        AllGatherRequest r;
        r.input = out.data();
        r.output = out.data();
        r.runs = runs.data();
        r.num_runs = 1;
        r.name = "head";
        ag.all_gather(r);
      },
      &errors);
  ASSERT_EQ(errors.size(), static_cast<size_t>(world));
  for (const auto& e : errors) {
    EXPECT_NE(e.find("all-gather of head (bucket 0) refused"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 2: 65 elements"), std::string::npos) << e;
  }
}

TEST(CompressedAllGather, FourBitRowsAreTheReferenceOnEveryRank) {
  for (int world : {2, 3}) {
    gather_and_compare(world, {{DType::kFloat32, 1001}}, 32,
                       WeightCodec::kInt4);  // odd: a pad nibble
    gather_and_compare(world, {{DType::kFloat32, 5}}, 16, WeightCodec::kInt4);
  }
  gather_and_compare(3, {{DType::kFloat32, 71}, {DType::kBFloat16, 33}, {DType::kFloat16, 129}}, 32,
                     WeightCodec::kInt4);
}

TEST(CompressedAllGather, FourBitBytesAreAboutFourBitsPerElementPlusTheScales) {
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  AllGatherOptions o;
  o.block_size = 32;
  o.codec = WeightCodec::kInt4;
  CompressedAllGather ag(group.communicator(0), *backend, o);
  const AllGatherRun run{DType::kFloat32, 1 << 20};
  EXPECT_EQ(ag.payload_bytes(&run, 1), 32u + 2u * (1u << 15) + (1u << 19));
}

// A NaN weight, and ranks of another codec: refused on every rank by name, as int8's are.
TEST(CompressedAllGather, FourBitRefusesNonFiniteShardsAndRanksOfAnotherCodec) {
  const int world = 3;
  const std::vector<AllGatherRun> runs = {{DType::kFloat32, 100}};
  const uint64_t row = all_gather_row_bytes(runs.data(), 1);
  for (bool mixed_codecs : {false, true}) {
    InProcessGroup group(world);
    std::vector<std::string> errors;
    run_ranks(
        group,
        [&](int rank, Communicator& comm) {
          auto backend = make_cpu_backend();
          AllGatherOptions o;
          o.block_size = 32;
          o.codec = mixed_codecs && rank == 2 ? WeightCodec::kInt8 : WeightCodec::kInt4;
          CompressedAllGather ag(comm, *backend, o);
          std::vector<uint8_t> out(row * world, 0);
          std::vector<uint8_t> mine = shard_of(rank, runs);
          if (rank == 1 && !mixed_codecs) {
            const float inf = INFINITY;
            std::memcpy(mine.data() + 4 * 42, &inf, 4);
          }
          std::memcpy(out.data() + row * rank, mine.data(), row);
          AllGatherRequest r;
          r.input = out.data() + row * rank;
          r.output = out.data();
          r.runs = runs.data();
          r.num_runs = 1;
          r.bucket_id = 7;
          r.name = "blocks.3";
          ag.all_gather(r);
        },
        &errors);
    ASSERT_EQ(errors.size(), static_cast<size_t>(world));
    for (const auto& e : errors) {
      if (mixed_codecs) {
        EXPECT_NE(e.find("all-gather of blocks.3 (bucket 7) refused"), std::string::npos) << e;
        EXPECT_NE(e.find("rank 2: 100 elements in 1 runs, int8 blocks of 32"), std::string::npos)
            << e;
        EXPECT_NE(e.find("rank 0: 100 elements in 1 runs, 4-bit blocks of 32"), std::string::npos)
            << e;
      } else {
        EXPECT_NE(e.find("4-bit all-gather of blocks.3 (bucket 7)"), std::string::npos) << e;
        EXPECT_NE(e.find("rank(s) 1 hold NaN or infinity"), std::string::npos) << e;
      }
    }
    if (!mixed_codecs)
      EXPECT_NE(errors[1].find("this rank's first is element 42 of run 0"), std::string::npos)
          << errors[1];
  }
}

TEST(CompressedAllGather, BadOptionsAreRefused) {
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  AllGatherOptions o;
  o.block_size = 48;
  EXPECT_THROW(CompressedAllGather(group.communicator(0), *backend, o), Error);
  o.codec = WeightCodec::kInt4;
  EXPECT_THROW(CompressedAllGather(group.communicator(0), *backend, o), Error);
}

}  // namespace
}  // namespace gradcomp
