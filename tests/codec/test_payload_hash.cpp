// A fixed corpus of payloads, residuals and averaged buckets, hashed; refactors keep it equal.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <thread>

#include "gradcomp/collectives.h"
#include "gradcomp/inprocess_group.h"
#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

// FNV-1a over every byte the corpus produces, in a fixed order.
class Fnv64 {
 public:
  void add(const void* data, size_t bytes) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < bytes; ++i) {
      h_ ^= p[i];
      h_ *= 1099511628211ull;
    }
  }
  template <typename T>
  void add(const std::vector<T>& v) {
    add(v.data(), v.size() * sizeof(T));
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

// Inputs with the awkward values a codec must get right: zeros, a denormal, huge magnitudes and,
// where asked, one NaN.
HostTensor corpus_tensor(DType dtype, int64_t n, uint32_t seed, bool with_nan) {
  std::vector<float> v = testing::normal_floats(n, seed);
  if (n > 3) v[3] = 0.0f;
  if (n > 5) v[5] = 1e-41f;
  if (n > 17) v[17] = dtype == DType::kFloat16 ? 60000.0f : 3e38f;
  if (with_nan && n > 40) v[40] = std::nanf("");
  return HostTensor::from_floats(dtype, v);
}

const int64_t kLengths[] = {1, 63, 64, 65, 1000, 4099, 70001};
const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

uint64_t codec_corpus_hash() {
  Fnv64 h;
  uint32_t seed = 1;
  for (DType dtype : kDtypes) {
    for (int64_t n : kLengths) {
      for (int block : {16, 64, 256}) {
        for (bool stochastic : {true, false}) {
          HostTensor x = corpus_tensor(dtype, n, seed++, block == 64);
          const std::vector<float> r = testing::normal_floats(n, seed++, 0.05f);
          auto enc = testing::q4_encode_tensor(x, block, stochastic, {77, 3, 9, 2, 1}, r, true);
          h.add(enc.payload);
          h.add(enc.residual);
          HostTensor other = corpus_tensor(dtype, n, seed++, false);
          auto enc2 = testing::q4_encode_tensor(other, block, stochastic, {77, 3, 9, 3, 0});
          h.add(enc2.payload);
          for (DType out : kDtypes) {
            HostTensor sum =
                testing::q4_decode_payloads({&enc.payload, &enc2.payload}, n, block, out, 2.0f);
            h.add(sum.bytes);
          }
        }
      }
      for (bool exact : {true, false}) {
        for (DType value_dtype : kDtypes) {
          HostTensor x = corpus_tensor(dtype, n, seed++, value_dtype == DType::kFloat16);
          const std::vector<float> r = testing::normal_floats(n, seed++, 0.05f);
          TopKOptions o;
          o.ratio = 0.03;
          o.exact = exact;
          o.value_dtype = value_dtype;
          const int64_t k = topk_k(n, o.ratio), cap = topk_capacity(n, o);
          auto enc = testing::topk_encode_tensor(x, k, cap, exact, value_dtype, r);
          h.add(enc.payload);
          h.add(enc.residual);
          HostTensor out(dtype, n);
          Segment seg = out.segment();
          std::vector<const uint8_t*> ptrs = {enc.payload.data(), enc.payload.data()};
          cpu::topk_decode(testing::topk_decode_params(ptrs, enc.payload.size(), n, cap,
                                                       value_dtype, &seg, dtype, 2.0f));
          h.add(out.bytes);
        }
      }
    }
  }
  return h.value();
}

uint64_t collective_corpus_hash() {
  std::vector<CompressionConfig> configs;
  CompressionConfig c;
  c.seed = 99;
  configs.push_back(c);
  c.residual_dtype = DType::kBFloat16;
  configs.push_back(c);
  c.residual_dtype = DType::kFloat32;
  c.q4_algorithm = Q4Algorithm::kOnePhase;
  configs.push_back(c);
  c = CompressionConfig{};
  c.codec = Codec::kTopK;
  c.topk.ratio = 0.02;
  configs.push_back(c);
  c.topk.exact = false;
  c.topk.value_dtype = DType::kBFloat16;
  configs.push_back(c);
  Fnv64 h;
  for (const CompressionConfig& config : configs) {
    for (int world : {1, 2, 3, 4}) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        InProcessGroup group(world);
        std::vector<std::vector<uint8_t>> results(world);
        std::vector<CompressionState> states(world);
        std::vector<std::thread> threads;
        for (int rank = 0; rank < world; ++rank) {
          threads.emplace_back([&, rank] {
            auto backend = make_cpu_backend();
            CompressedAllreduce engine(group.communicator(rank), *backend, config);
            for (uint32_t step = 0; step < 3; ++step) {
              // Two tensors in one bucket, so the segment paths are part of the corpus.
              HostTensor a = corpus_tensor(dtype, 3001, 10 * step + rank, step == 1 && rank == 0);
              HostTensor b = corpus_tensor(dtype, 517, 500 + 10 * step + rank, false);
              Segment segs[2] = {{a.data(), 0, a.numel}, {b.data(), a.numel, b.numel}};
              engine.allreduce(segs, 2, dtype, 5);
              engine.advance_step();
              results[rank].insert(results[rank].end(), a.bytes.begin(), a.bytes.end());
              results[rank].insert(results[rank].end(), b.bytes.begin(), b.bytes.end());
            }
            states[rank] = engine.state();
          });
        }
        for (auto& t : threads) t.join();
        for (int rank = 0; rank < world; ++rank) {
          h.add(results[rank]);
          for (const auto& kv : states[rank].residuals) h.add(kv.second);
          for (const auto& kv : states[rank].chunk_residuals) h.add(kv.second);
        }
      }
    }
  }
  return h.value();
}

// q2 (issue 36): its codec corpus, and its two-phase and one-phase allreduce at W = 2 and 3.
uint64_t q2_corpus_hash() {
  Fnv64 h;
  uint32_t seed = 7;
  for (DType dtype : kDtypes) {
    for (int64_t n : kLengths) {
      for (int block : {16, 64, 256}) {
        for (bool stochastic : {true, false}) {
          HostTensor x = corpus_tensor(dtype, n, seed++, block == 64);
          const std::vector<float> r = testing::normal_floats(n, seed++, 0.05f);
          auto enc = testing::q2_encode_tensor(x, block, stochastic, {77, 3, 9, 2, 1}, r, true);
          h.add(enc.payload);
          h.add(enc.residual);
          HostTensor other = corpus_tensor(dtype, n, seed++, false);
          auto enc2 = testing::q2_encode_tensor(other, block, stochastic, {77, 3, 9, 3, 0});
          for (DType out : kDtypes)
            h.add(testing::q2_decode_payloads({&enc.payload, &enc2.payload}, n, block, out, 2.0f)
                      .bytes);
        }
      }
    }
  }
  for (Q4Algorithm algorithm : {Q4Algorithm::kTwoPhase, Q4Algorithm::kOnePhase}) {
    CompressionConfig config;
    config.codec = Codec::kQ2;
    config.q4_algorithm = algorithm;
    config.seed = 99;
    for (int world : {2, 3}) {
      InProcessGroup group(world);
      std::vector<std::vector<uint8_t>> results(world);
      std::vector<std::thread> threads;
      for (int rank = 0; rank < world; ++rank) {
        threads.emplace_back([&, rank] {
          auto backend = make_cpu_backend();
          CompressedAllreduce engine(group.communicator(rank), *backend, config);
          for (uint32_t step = 0; step < 3; ++step) {
            HostTensor a = corpus_tensor(DType::kFloat32, 3001, 10 * step + rank, false);
            Segment seg = a.segment();
            engine.allreduce(&seg, 1, DType::kFloat32, 5);
            engine.advance_step();
            results[rank].insert(results[rank].end(), a.bytes.begin(), a.bytes.end());
          }
        });
      }
      for (auto& t : threads) t.join();
      for (int rank = 0; rank < world; ++rank) h.add(results[rank]);
    }
  }
  return h.value();
}

// A change of either value means some payload byte, residual or averaged gradient changed. The
// collective corpus was recorded before the remodel of the element math, backends and engine
// (issue 8) and has not changed since; the codec corpus was recorded again for wire format v2,
// whose headers carry a body checksum (v1: 0x1bc107b3fd39c021). Both were recorded again when
// every NaN the element math computes became CUDA's canonical NaN (the first GPU run found the
// host passing on x86's NaNs; before: 0x8a4363f04d90acc4 and 0xa7d7395b468dcd14).
constexpr uint64_t kCodecCorpusHash = 0x5faa045ad9890be9ull;
constexpr uint64_t kCollectiveCorpusHash = 0xe20bb6b5a09d3644ull;
// Recorded when q2 came (2026-12-06); a change means a q2 payload byte or mean changed.
constexpr uint64_t kQ2CorpusHash = 0x960a4100bbe4b4fdull;

TEST(PayloadHash, CodecCorpusIsUnchangedWithEveryInstructionSet) {
  const cpu::Isa chosen = cpu::active_isa();
  for (cpu::Isa isa : {cpu::Isa::kPortable, cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (!cpu::isa_supported(isa)) continue;
    cpu::set_active_isa(isa);
    const uint64_t hash = codec_corpus_hash();
    EXPECT_EQ(hash, kCodecCorpusHash) << cpu::isa_name(isa) << ": " << std::hex << hash;
  }
  cpu::set_active_isa(chosen);
}

TEST(PayloadHash, Q2CorpusIsUnchanged) {
  const uint64_t hash = q2_corpus_hash();
  EXPECT_EQ(hash, kQ2CorpusHash) << std::hex << hash;
}

TEST(PayloadHash, CollectiveCorpusIsUnchanged) {
  EXPECT_EQ(collective_corpus_hash(), kCollectiveCorpusHash)
      << std::hex << collective_corpus_hash();
}

}  // namespace
}  // namespace gradcomp
