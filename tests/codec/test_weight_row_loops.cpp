// The weight row codecs' loops (int8, 4-bit) for each instruction set write their element-by-
// element reference's bytes: every dtype, block size, odd length, misaligned row, NaN and infinity.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu_weight_row_loops.h"
#include "gradcomp/cpu.h"
#include "int4_params.h"

namespace gradcomp {
namespace {

// Restores the process-wide instruction set when a test ends.
class IsaGuard {
 public:
  IsaGuard() : saved_(cpu::active_isa()) {}
  ~IsaGuard() { cpu::set_active_isa(saved_); }

 private:
  cpu::Isa saved_;
};

std::vector<cpu::Isa> supported_isas() {
  std::vector<cpu::Isa> out;
  for (cpu::Isa isa : {cpu::Isa::kPortable, cpu::Isa::kAvx2, cpu::Isa::kAvx512})
    if (cpu::isa_supported(isa)) out.push_back(isa);
  return out;
}

const uint8_t kDtypes[] = {math::kDtypeF32, math::kDtypeF16, math::kDtypeBF16};

using cpu::detail::WeightRowCodec;
const WeightRowCodec kCodecs[] = {cpu::detail::kInt8RowCodec, cpu::detail::kInt4RowCodec};
constexpr uint8_t kCanary = 0xA5;
constexpr size_t kGuard = 64;

// Gaussian values whose magnitude changes per 16 elements, with blocks of zeros, signed zeros,
// denormals, ties (of int8's codes and of 4-bit ones) and values near the dtype's largest, stored
// as `dtype` at byte offset `misalign`.
std::vector<uint8_t> row_bytes(const std::vector<Int8Run>& runs, size_t misalign, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<uint8_t> bytes(misalign + int8_row_bytes(runs.data(), static_cast<int>(runs.size())));
  size_t at = misalign;
  for (const Int8Run& run : runs) {
    for (int64_t i = 0; i < run.numel; ++i) {
      float v = std::ldexp(normal(gen), static_cast<int>((i / 16) % 11) - 5);
      switch ((i / 16) % 8) {
        case 1:
          v = (i & 1) ? 0.0f : -0.0f;
          break;
        case 3:
          v *= run.dtype == math::kDtypeF16 ? 1e-7f : 1e-40f;
          break;
        case 4:  // scale 1 and halves: every code a tie, rounded to even
          v = i % 16 == 0 ? 127.0f : static_cast<float>(static_cast<int>(gen() % 253) - 126) + 0.5f;
          break;
        case 5:
          if (gen() % 5 == 0) v = run.dtype == math::kDtypeF16 ? 65504.0f : -3.0e38f;
          break;
        case 6:  // the 4-bit codec's scale 1: every code a tie
          v = i % 16 == 0 ? -7.0f : static_cast<float>(static_cast<int>(gen() % 13) - 6) + 0.5f;
          break;
        default:
          break;
      }
      const float stored = math::round_to_dtype(v, run.dtype);
      if (run.dtype == math::kDtypeF32) {
        std::memcpy(&bytes[at], &stored, 4);
      } else {
        const uint16_t h = run.dtype == math::kDtypeF16 ? math::float_to_half(stored)
                                                        : math::float_to_bf16(stored);
        std::memcpy(&bytes[at], &h, 2);
      }
      at += math::dtype_bytes(run.dtype);
    }
  }
  return bytes;
}

void put(std::vector<uint8_t>& bytes, size_t at, uint8_t dtype, float v) {
  if (dtype == math::kDtypeF32) {
    std::memcpy(&bytes[at], &v, 4);
  } else {
    const uint16_t h = dtype == math::kDtypeF16 ? math::float_to_half(v) : math::float_to_bf16(v);
    std::memcpy(&bytes[at], &h, 2);
  }
}

// Encodes with the active loops into a guarded buffer and with the reference; expects the same
// return, the same bytes, and the guards intact. Returns the payload.
std::vector<uint8_t> expect_encode_equal(const WeightRowCodec& codec, const uint8_t* input,
                                         const std::vector<Int8Run>& runs, uint32_t block) {
  const int nr = static_cast<int>(runs.size());
  const uint64_t total = codec.payload_bytes(runs.data(), nr, block);
  std::vector<uint8_t> want(total, 0x5A), got(total + 2 * kGuard, kCanary);
  const uint64_t want_bad = codec.encode_reference(input, runs.data(), nr, block, want.data());
  const uint64_t got_bad = codec.encode(input, runs.data(), nr, block, got.data() + kGuard);
  EXPECT_EQ(got_bad, want_bad);
  EXPECT_EQ(0, std::memcmp(got.data() + kGuard, want.data(), total));
  for (size_t i = 0; i < kGuard; ++i) {
    EXPECT_EQ(got[i], kCanary) << "wrote before the payload";
    EXPECT_EQ(got[kGuard + total + i], kCanary) << "wrote after the payload";
  }
  return want;
}

void expect_decode_equal(const WeightRowCodec& codec, const uint8_t* payload,
                         const std::vector<Int8Run>& runs, uint32_t block, size_t misalign) {
  const int nr = static_cast<int>(runs.size());
  const uint64_t row = int8_row_bytes(runs.data(), nr);
  std::vector<uint8_t> want(row, 0x5A), got(row + 2 * kGuard + misalign, kCanary);
  codec.decode_reference(payload, runs.data(), nr, block, want.data());
  codec.decode(payload, runs.data(), nr, block, got.data() + kGuard + misalign);
  EXPECT_EQ(0, std::memcmp(got.data() + kGuard + misalign, want.data(), row));
  for (size_t i = 0; i < kGuard + misalign; ++i) EXPECT_EQ(got[i], kCanary) << "wrote before";
  for (size_t i = 0; i < kGuard; ++i)
    EXPECT_EQ(got[kGuard + misalign + row + i], kCanary) << "wrote after the row";
}

TEST(WeightRowLoops, EveryIsaDtypeBlockSizeLengthAndAlignmentEqualsTheReference) {
  IsaGuard guard;
  for (const WeightRowCodec& codec : kCodecs) {
    for (cpu::Isa isa : supported_isas()) {
      cpu::set_active_isa(isa);
      for (uint8_t dtype : kDtypes) {
        for (uint32_t block = math::kInt8MinBlock; block <= math::kInt8MaxBlock; block *= 2) {
          // 16385: more than one 4-bit staging chunk (16384 codes) in a run.
          for (int64_t n : {1, 7, 15, 16, 17, 33, 1000, 4097, 9001, 16385}) {
            for (size_t misalign : {0, 1, 2, 3}) {
              SCOPED_TRACE(testing::Message()
                           << codec.name << " " << cpu::isa_name(isa) << " dtype " << int(dtype)
                           << " block " << block << " n " << n << " +" << misalign);
              const std::vector<Int8Run> runs = {{dtype, n}};
              const auto input = row_bytes(runs, misalign, static_cast<uint32_t>(n + block));
              const auto payload = expect_encode_equal(codec, input.data() + misalign, runs, block);
              expect_decode_equal(codec, payload.data(), runs, block, misalign);
              if (HasFailure()) return;
            }
          }
        }
      }
    }
  }
}

TEST(WeightRowLoops, MixedDtypeRowsAtEveryByteOffsetEqualTheReference) {
  IsaGuard guard;
  const std::vector<Int8Run> runs = {{math::kDtypeBF16, 37},  {math::kDtypeF32, 300},
                                     {math::kDtypeF16, 129},  {math::kDtypeBF16, 1},
                                     {math::kDtypeF32, 4096}, {math::kDtypeF16, 17}};
  for (const WeightRowCodec& codec : kCodecs) {
    for (cpu::Isa isa : supported_isas()) {
      cpu::set_active_isa(isa);
      for (uint32_t block : {16u, 64u, 4096u}) {
        for (size_t misalign = 0; misalign < 8; ++misalign) {
          SCOPED_TRACE(testing::Message() << codec.name << " " << cpu::isa_name(isa) << " block "
                                          << block << " +" << misalign);
          const auto input = row_bytes(runs, misalign, 7 + block);
          const auto payload = expect_encode_equal(codec, input.data() + misalign, runs, block);
          expect_decode_equal(codec, payload.data(), runs, block, misalign);
        }
      }
    }
  }
}

// NaN and infinity anywhere (vector body, tail, first and last block, a later run) are refused
// alike: the same first offset and the same flagged, empty payload as the reference.
TEST(WeightRowLoops, NonFiniteElementsAreRefusedLikeTheReference) {
  IsaGuard guard;
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (const WeightRowCodec& codec : kCodecs) {
    for (cpu::Isa isa : supported_isas()) {
      cpu::set_active_isa(isa);
      for (uint8_t dtype : kDtypes) {
        const std::vector<Int8Run> runs = {{math::kDtypeF32, 50}, {dtype, 203}};
        for (int64_t at : {0, 5, 16, 31, 47, 50, 51, 66, 200, 252}) {
          for (float v : bad) {
            for (size_t misalign : {0, 2}) {
              SCOPED_TRACE(testing::Message()
                           << codec.name << " " << cpu::isa_name(isa) << " dtype " << int(dtype)
                           << " at " << at << " value " << v);
              auto input = row_bytes(runs, misalign, 3);
              if (at < 50) {
                put(input, misalign + 4 * at, math::kDtypeF32, v);
              } else {
                put(input, misalign + 200 + math::dtype_bytes(dtype) * (at - 50), dtype, v);
              }
              if (at == 51) put(input, misalign + 4 * 3, math::kDtypeF32, -v);  // the first wins
              expect_encode_equal(codec, input.data() + misalign, runs, 16);
              const auto nr = static_cast<int>(runs.size());
              std::vector<uint8_t> out(codec.payload_bytes(runs.data(), nr, 16));
              const uint64_t got_at =
                  codec.encode(input.data() + misalign, runs.data(), nr, 16, out.data());
              EXPECT_EQ(got_at, 1 + static_cast<uint64_t>(at == 51 ? 3 : at));
              EXPECT_EQ(codec.verdict(out.data(), runs.data(), nr, 16), kInt8Nonfinite);
            }
          }
        }
      }
    }
  }
}

// Decoding bytes no encoder wrote (a forged scale of NaN, infinity or the largest bf16, any
// codes) still gives the reference's bytes in every dtype.
TEST(WeightRowLoops, DecodeOfArbitraryBodiesEqualsTheReference) {
  IsaGuard guard;
  std::mt19937 gen(11);
  for (const WeightRowCodec& codec : kCodecs) {
    for (cpu::Isa isa : supported_isas()) {
      cpu::set_active_isa(isa);
      for (uint8_t dtype : kDtypes) {
        // Two runs of odd length: the second's codes start in a byte's high nibble under 4 bits.
        const std::vector<Int8Run> runs = {{dtype, 16 * 40 + 9}, {math::kDtypeBF16, 77}};
        std::vector<uint8_t> payload(codec.payload_bytes(runs.data(), 2, 16));
        for (auto& b : payload) b = static_cast<uint8_t>(gen());
        const uint16_t forged[] = {0x7FC0, 0xFF80, 0x7F7F, 0x0001, 0x8000, 0x7F81, 0x4780};
        for (size_t k = 0; k < sizeof(forged) / sizeof(forged[0]); ++k)
          std::memcpy(&payload[kInt8HeaderBytes + 2 * (3 * k)], &forged[k], 2);
        SCOPED_TRACE(testing::Message()
                     << codec.name << " " << cpu::isa_name(isa) << " dtype " << int(dtype));
        expect_decode_equal(codec, payload.data(), runs, 16, 1);
      }
    }
  }
}

// The nibble packing of each instruction set, at both parities of the first nibble and every
// length around its 32-code step, writes what the portable loop writes and nothing else, and
// unpacks to the codes it packed.
TEST(WeightRowLoops, FourBitPackingOfEveryIsaEqualsThePortableLoop) {
  std::mt19937 gen(5);
  std::vector<int8_t> codes(100);
  for (auto& c : codes) c = static_cast<int8_t>(static_cast<int>(gen() % 15) - 7);
  for (cpu::Isa isa : supported_isas()) {
    for (uint64_t first : {0, 1, 2, 3}) {
      for (int64_t n = 0; n <= 100; ++n) {
        SCOPED_TRACE(testing::Message() << cpu::isa_name(isa) << " first " << first << " n " << n);
        std::vector<uint8_t> want(64, kCanary), got(64, kCanary);
        want[first / 2] = got[first / 2] = 0x03;  // a low nibble written before, for odd `first`
        cpu::detail::pack_codes_portable(codes.data(), n, first, want.data());
        cpu::detail::int4_pack_codes(codes.data(), n, first, got.data(), isa);
        EXPECT_EQ(got, want);
        std::vector<int8_t> back(n + 1, 99);
        cpu::detail::int4_unpack_codes(got.data(), first, n, back.data(), isa);
        EXPECT_EQ(0, std::memcmp(back.data(), codes.data(), static_cast<size_t>(n)));
        EXPECT_EQ(back[n], 99) << "unpacked past n";
        if (HasFailure()) return;
      }
    }
  }
}

TEST(WeightRowLoops, BodyChecksumOfEveryIsaEqualsTheScalarSum) {
  std::mt19937 gen(2);
  std::vector<uint8_t> body(4 * 203 + 3);
  for (auto& b : body) b = static_cast<uint8_t>(gen());
  for (uint64_t words = 0; words <= 203; ++words) {
    uint64_t want = 0;
    for (uint64_t i = 0; i < words; ++i) {
      uint32_t w;
      std::memcpy(&w, &body[3 + 4 * i], 4);
      want += static_cast<uint64_t>(w) * (2 * i + 1);
    }
    for (cpu::Isa isa : supported_isas())
      EXPECT_EQ(cpu::detail::int8_body_sum(body.data() + 3, words, isa), want)
          << cpu::isa_name(isa) << " words " << words;
  }
}

}  // namespace
}  // namespace gradcomp
