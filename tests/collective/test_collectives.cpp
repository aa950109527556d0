// Compressed collectives with in-process ranks: equality with a decode-and-sum reference,
// bytes on the wire, layout checks, non-finite steps and checkpoint round trips.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <thread>

#include "gradcomp/collectives.h"
#include "gradcomp/fault_injection.h"
#include "gradcomp/inprocess_group.h"
#include "run_ranks.h"
#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;
using testing::run_ranks;

struct Variant {
  const char* name;
  CompressionConfig config;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  CompressionConfig c;
  c.seed = 1234;
  v.push_back({"q4_two_phase", c});
  c.q4_algorithm = Q4Algorithm::kOnePhase;
  v.push_back({"q4_one_phase", c});
  c = CompressionConfig{};
  c.codec = Codec::kTopK;
  c.topk.ratio = 0.05;
  c.seed = 1234;
  v.push_back({"topk_exact", c});
  c.topk.exact = false;
  v.push_back({"topk_approx", c});
  // Small pieces, so that the reference (one piece) meets buckets of many, overlapped.
  c = CompressionConfig{};
  c.seed = 1234;
  c.piece_numel = 256;
  v.push_back({"q4_two_phase_in_pieces", c});
  return v;
}

// An independent decode-and-sum reference of each algorithm, built from the codec calls, keeping
// every rank's residuals itself.
class Reference {
 public:
  // key_ranks: the rank each member's random bits are keyed by (default: its place).
  Reference(const CompressionConfig& c, int world, int64_t n, std::vector<uint32_t> key_ranks = {})
      : c_(c), world_(world), n_(n), key_ranks_(std::move(key_ranks)) {
    if (key_ranks_.empty())
      for (int w = 0; w < world; ++w) key_ranks_.push_back(static_cast<uint32_t>(w));
    res1_.assign(world, std::vector<float>(n, 0.0f));
    const int B = c.q4.block_size;
    chunk_ = std::max<int64_t>(B, ((n + world - 1) / world + B - 1) / B * B);
    res2_.assign(world, std::vector<float>(chunk_, 0.0f));
  }

  std::vector<float> step(std::vector<HostTensor>& x, uint32_t step, uint32_t bucket) {
    if (c_.codec == Codec::kTopK) return topk(x);
    if (c_.q4_algorithm == Q4Algorithm::kOnePhase) return one_phase(x, step, bucket);
    return two_phase(x, step, bucket);
  }

 private:
  int64_t cn(int c) const {
    return std::max<int64_t>(0, std::min(n_, (c + 1) * chunk_) - c * chunk_);
  }

  std::vector<uint8_t> encode(Segment seg, int64_t begin, int64_t numel, std::vector<float>& res,
                              math::RngKey key) {
    std::vector<uint8_t> out(q4_payload_bytes(numel, c_.q4.block_size));
    std::vector<float> next(res.size());
    Q4EncodeParams p;
    p.segments = &seg;
    p.num_segments = 1;
    p.dtype = math::kDtypeF32;
    p.begin = begin;
    p.numel = numel;
    p.residual_in = res.data();
    p.residual_out = next.data();
    p.block_size = c_.q4.block_size;
    p.rng = key;
    p.payload = out.data();
    cpu::q4_encode(p);
    res = next;
    return out;
  }

  void decode(const std::vector<const uint8_t*>& ptrs, uint64_t bytes, int64_t numel, float* out,
              int64_t begin, float divisor) {
    Segment seg{out, begin, numel};
    Q4DecodeParams d;
    d.payloads = ptrs.data();
    d.num_payloads = static_cast<int>(ptrs.size());
    d.payload_bytes = bytes;
    d.numel = numel;
    d.block_size = c_.q4.block_size;
    d.segments = &seg;
    d.num_segments = 1;
    d.begin = begin;
    d.divisor = divisor;
    cpu::q4_decode(d);
  }

  std::vector<float> two_phase(std::vector<HostTensor>& x, uint32_t step, uint32_t bucket) {
    std::vector<std::vector<std::vector<uint8_t>>> p1(world_);
    for (int w = 0; w < world_; ++w) {
      for (int c = 0; c < world_; ++c) {
        std::vector<float> r(res1_[w].begin() + c * chunk_, res1_[w].begin() + c * chunk_ + cn(c));
        p1[w].push_back(encode(x[w].segment(), c * chunk_, cn(c), r,
                               {c_.seed, step, bucket, key_ranks_[w], 0}));
        std::copy(r.begin(), r.end(), res1_[w].begin() + c * chunk_);
      }
    }
    std::vector<float> result(n_);
    for (int c = 0; c < world_; ++c) {
      std::vector<const uint8_t*> ptrs;
      for (int w = 0; w < world_; ++w) ptrs.push_back(p1[w][c].data());
      std::vector<float> sum(chunk_);
      decode(ptrs, p1[0][c].size(), cn(c), sum.data(), c * chunk_, 1.0f);
      std::vector<float> r(res2_[c].begin(), res2_[c].begin() + cn(c));
      auto p2 = encode(Segment{sum.data(), c * chunk_, chunk_}, c * chunk_, cn(c), r,
                       {c_.seed, step, bucket, key_ranks_[c], 1});
      std::copy(r.begin(), r.end(), res2_[c].begin());
      decode({p2.data()}, p2.size(), cn(c), result.data() + c * chunk_, c * chunk_, float(world_));
    }
    return result;
  }

  std::vector<float> one_phase(std::vector<HostTensor>& x, uint32_t step, uint32_t bucket) {
    std::vector<std::vector<uint8_t>> p(world_);
    std::vector<const uint8_t*> ptrs;
    for (int w = 0; w < world_; ++w) {
      p[w] = encode(x[w].segment(), 0, n_, res1_[w], {c_.seed, step, bucket, key_ranks_[w], 0});
      ptrs.push_back(p[w].data());
    }
    std::vector<float> result(n_);
    decode(ptrs, p[0].size(), n_, result.data(), 0, float(world_));
    return result;
  }

  std::vector<float> topk(std::vector<HostTensor>& x) {
    const int64_t k = topk_k(n_, c_.topk.ratio), cap = topk_capacity(n_, c_.topk);
    std::vector<testing::TopKEncoded> enc;
    std::vector<const uint8_t*> ptrs;
    for (int w = 0; w < world_; ++w) {
      enc.push_back(
          testing::topk_encode_tensor(x[w], k, cap, c_.topk.exact, c_.topk.value_dtype, res1_[w]));
      res1_[w] = enc.back().residual;
    }
    for (auto& e : enc) ptrs.push_back(e.payload.data());
    HostTensor out(DType::kFloat32, n_);
    Segment seg = out.segment();
    cpu::topk_decode(testing::topk_decode_params(ptrs, enc[0].payload.size(), n_, cap,
                                                 c_.topk.value_dtype, &seg, DType::kFloat32,
                                                 float(world_)));
    return out.floats();
  }

  CompressionConfig c_;
  int world_;
  int64_t n_, chunk_;
  std::vector<uint32_t> key_ranks_;
  std::vector<std::vector<float>> res1_, res2_;
};

// Five steps of a bf16 bucket of n elements (the state saved before step 3), then a fresh
// allreduce that loads that state and redoes steps 3 and 4: step 4's result both ways.
struct RoundTrip {
  std::vector<float> uninterrupted, resumed;
  CompressionState saved;
};

template <typename Make>
RoundTrip checkpoint_round_trip(const Make& make, int rank, int64_t n) {
  auto input = [&](uint32_t step) {
    return HostTensor::from_floats(DType::kBFloat16, testing::normal_floats(n, 100 * step + rank));
  };
  RoundTrip r;
  auto run = [&](CompressedAllreduce& a, uint32_t from, std::vector<float>& last) {
    for (uint32_t step = from; step < 5; ++step) {
      if (step == 3 && from == 0) r.saved = a.state();
      HostTensor x = input(step);
      Segment seg = x.segment();
      a.allreduce(&seg, 1, DType::kBFloat16, 11);
      a.advance_step();
      if (step == 4) last = x.floats();
    }
  };
  std::unique_ptr<CompressedAllreduce> a = make();
  run(*a, 0, r.uninterrupted);
  std::unique_ptr<CompressedAllreduce> b = make();
  b->load_state(r.saved);
  run(*b, 3, r.resumed);
  EXPECT_EQ(b->step(), 5u);
  return r;
}

// Every one of `world` ranks raised a layout mismatch naming rank `odd`'s 1064-element bucket.
void expect_layout_mismatch_on_every_rank(const std::vector<std::string>& errors, size_t world,
                                          int odd) {
  ASSERT_EQ(errors.size(), world);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("layout mismatch"), std::string::npos) << e;
    EXPECT_NE(e.find("rank " + std::to_string(odd) + " has bucket 0 with 1064 elements"),
              std::string::npos)
        << e;
  }
}

// Every rank's fp32 bucket of n elements at `step`.
std::vector<HostTensor> step_inputs(int world, int64_t n, uint32_t step) {
  std::vector<HostTensor> inputs;
  for (int r = 0; r < world; ++r)
    inputs.push_back(
        HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 1000 * step + r)));
  return inputs;
}

class CollectiveEquality : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(CollectiveEquality, MatchesTheDecodeAndSumReferenceAndTheByteFormula) {
  const int world = std::get<0>(GetParam());
  const Variant v = variants()[std::get<1>(GetParam())];
  for (int64_t n : {1, 1000, 4099}) {
    InProcessGroup group(world);
    Reference ref(v.config, world, n);
    std::vector<std::vector<float>> results(world);
    std::vector<uint64_t> sent(world);
    std::vector<std::unique_ptr<Backend>> backends;
    for (int r = 0; r < world; ++r) backends.push_back(make_cpu_backend());
    std::vector<std::unique_ptr<CompressedAllreduce>> engines(world);
    for (uint32_t step = 0; step < 3; ++step) {
      std::vector<HostTensor> inputs = step_inputs(world, n, step);
      std::vector<float> expect = ref.step(inputs, step, 7);
      run_ranks(group, [&](int rank, Communicator& comm) {
        if (!engines[rank])
          engines[rank] = std::make_unique<CompressedAllreduce>(comm, *backends[rank], v.config);
        engines[rank]->set_step(step);
        HostTensor x = inputs[rank];
        Segment seg = x.segment();
        const uint64_t before = comm.bytes_sent();
        ASSERT_TRUE(engines[rank]->allreduce(&seg, 1, DType::kFloat32, 7));
        sent[rank] = comm.bytes_sent() - before;
        results[rank] = x.floats();
      });
      for (int r = 0; r < world; ++r) {
        for (int64_t i = 0; i < n; ++i)
          ASSERT_TRUE(testing::same_bits(results[r][i], expect[i]))
              << v.name << " W=" << world << " n=" << n << " step " << step << " rank " << r
              << " element " << i << ": " << results[r][i] << " vs " << expect[i];
        if (step > 0)
          EXPECT_EQ(sent[r], compressed_allreduce_bytes_sent(v.config, n, world)) << v.name;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectiveEquality,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Range(0, 5)));

// Four steps of a bf16 bucket of n elements at W = 3: every rank's results and final state.
struct PiecedRun {
  std::vector<std::vector<uint8_t>> out;
  std::vector<CompressionState> state;
  std::vector<uint64_t> last_sent;
};

PiecedRun run_in_pieces(const CompressionConfig& c, int64_t n) {
  const int world = 3;
  InProcessGroup group(world);
  PiecedRun r{std::vector<std::vector<uint8_t>>(world), std::vector<CompressionState>(world),
              std::vector<uint64_t>(world)};
  run_ranks(group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce a(comm, *backend, c);
    for (uint32_t step = 0; step < 4; ++step) {
      HostTensor x = HostTensor::from_floats(
          DType::kBFloat16, testing::normal_floats(n, 10 * step + rank, 1.0f + rank));
      Segment seg = x.segment();
      const uint64_t before = comm.bytes_sent();
      ASSERT_TRUE(a.allreduce(&seg, 1, DType::kBFloat16, 5));
      r.last_sent[rank] = comm.bytes_sent() - before;
      a.advance_step();
      r.out[rank].insert(r.out[rank].end(), x.bytes.begin(), x.bytes.end());
    }
    r.state[rank] = a.state();
  });
  return r;
}

TEST(Pieces, AnyPieceSizeGivesTheOnePieceResultAndResidualsByteForByte) {
  CompressionConfig q4;
  q4.seed = 77;
  q4.residual_dtype = DType::kBFloat16;
  CompressionConfig topk_warmup;  // top-k's q4 warm-up runs two-phase q4 too
  topk_warmup.codec = Codec::kTopK;
  topk_warmup.remedies.warmup = TopKWarmup::kQ4;
  topk_warmup.remedies.warmup_steps = 2;
  for (const CompressionConfig& base : {q4, topk_warmup}) {
    for (int64_t n : {1000, 10007}) {
      CompressionConfig one = base;
      one.piece_numel = 0;
      const PiecedRun expect = run_in_pieces(one, n);
      for (int64_t piece : {int64_t{1}, int64_t{200}, int64_t{999}, int64_t{4096}}) {
        CompressionConfig c = base;
        c.piece_numel = piece;
        const PiecedRun got = run_in_pieces(c, n);
        for (int r = 0; r < 3; ++r) {
          EXPECT_EQ(got.out[r], expect.out[r]) << "n=" << n << " piece " << piece << " rank " << r;
          EXPECT_EQ(got.state[r].residuals, expect.state[r].residuals) << piece;
          EXPECT_EQ(got.state[r].chunk_residuals, expect.state[r].chunk_residuals) << piece;
          if (base.codec == Codec::kQ4)
            EXPECT_EQ(got.last_sent[r], compressed_allreduce_bytes_sent(c, n, 3)) << piece;
        }
      }
    }
  }
  CompressionConfig c;
  c.piece_numel = 200;
  EXPECT_EQ(q4_pieces(c, 10007, 3), 27);  // chunks of 3392 elements, pieces of 2 blocks
  EXPECT_EQ(q4_piece_size(c, 10007, 3), 128);
  c.piece_numel = 3 * 3392;
  EXPECT_EQ(q4_pieces(c, 10007, 3), 1);
  c.piece_numel = 3 * (3392 - 64);  // a block under a chunk each: two equal pieces, not 1 + 1 block
  EXPECT_EQ(q4_pieces(c, 10007, 3), 2);
  EXPECT_EQ(q4_piece_size(c, 10007, 3), 1728);
}

TEST(Pieces, RanksWithDifferentPieceSizesAreRefusedOnEveryRank) {
  InProcessGroup group(3, 5.0);
  std::vector<std::string> errors;
  run_ranks(
      group,
      [&](int rank, Communicator& comm) {
        auto backend = make_cpu_backend();
        CompressionConfig c;
        if (rank == 1) c.piece_numel = 512;
        CompressedAllreduce engine(comm, *backend, c);
        HostTensor x(DType::kFloat32, 5000);
        Segment seg = x.segment();
        engine.allreduce(&seg, 1, DType::kFloat32, 0);
      },
      &errors);
  ASSERT_EQ(errors.size(), 3u);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("layout mismatch"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 1 has bucket 0 with 5000 elements"), std::string::npos) << e;
    EXPECT_NE(e.find("pieces of 192 elements"), std::string::npos) << e;
  }
}

// ---- hierarchical: nodes x local ranks --------------------------------------------------------

// What the hierarchical allreduce computes, step by step: each shard averaged over its node (the
// in-process transport's arithmetic: x / L summed in local-rank order), the flat reference of
// that shard across nodes with random bits keyed by the global ranks, the shards put together.
class HierarchicalReference {
 public:
  HierarchicalReference(const CompressionConfig& c, int nodes, int local, int64_t n)
      : nodes_(nodes), local_(local), n_(n), shard_(node_shard_numel(n, local)) {
    for (int l = 0; l < local; ++l) {
      std::vector<uint32_t> keys;
      for (int node = 0; node < nodes; ++node) keys.push_back(node * local + l);
      inner_.emplace_back(c, nodes, shard_, keys);
    }
  }

  std::vector<float> step(const std::vector<HostTensor>& x, uint32_t step, uint32_t bucket) {
    std::vector<float> out(shard_ * local_);
    const float scale = 1.0f / static_cast<float>(local_);
    for (int l = 0; l < local_; ++l) {
      std::vector<HostTensor> shards;
      for (int node = 0; node < nodes_; ++node) {
        std::vector<float> mean(shard_, 0.0f);
        for (int j = 0; j < local_; ++j) {
          const std::vector<float> v = x[node * local_ + j].floats();
          for (int64_t i = 0; i < shard_; ++i) {
            const int64_t at = l * shard_ + i;
            mean[i] = math::add_rn(mean[i], math::mul_rn(at < n_ ? v[at] : 0.0f, scale));
          }
        }
        shards.push_back(HostTensor::from_floats(DType::kFloat32, mean));
      }
      const std::vector<float> r = inner_[l].step(shards, step, bucket);
      std::copy(r.begin(), r.end(), out.begin() + l * shard_);
    }
    out.resize(n_);
    return out;
  }

 private:
  int nodes_, local_;
  int64_t n_, shard_;
  std::vector<Reference> inner_;
};

class HierarchicalEquality : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(HierarchicalEquality, MatchesNodeMeanThenFlatReferencePerShardAndTheByteFormulas) {
  const int nodes = std::get<0>(GetParam()), local = std::get<1>(GetParam());
  const int world = nodes * local;
  const Variant v = variants()[std::get<2>(GetParam())];
  for (int64_t n : {1, 1000, 4099}) {
    testing::NodeGrid grid(nodes, local);
    HierarchicalReference ref(v.config, nodes, local, n);
    std::vector<std::vector<float>> results(world);
    std::vector<uint64_t> inter_sent(world), intra_sent(world);
    std::vector<std::unique_ptr<Backend>> backends;
    for (int r = 0; r < world; ++r) backends.push_back(make_cpu_backend());
    std::vector<std::unique_ptr<CompressedAllreduce>> engines(world);
    for (uint32_t step = 0; step < 3; ++step) {
      std::vector<HostTensor> inputs = step_inputs(world, n, step);
      const std::vector<float> expect = ref.step(inputs, step, 7);
      testing::run_grid(grid, [&](int rank, NodeGroups groups) {
        if (!engines[rank])
          engines[rank] = std::make_unique<CompressedAllreduce>(groups, *backends[rank], v.config);
        engines[rank]->set_step(step);
        HostTensor x = inputs[rank];
        Segment seg = x.segment();
        const uint64_t inter0 = groups.inter_node->bytes_sent();
        const uint64_t intra0 = groups.intra_node->bytes_sent();
        ASSERT_TRUE(engines[rank]->allreduce(&seg, 1, DType::kFloat32, 7));
        inter_sent[rank] = groups.inter_node->bytes_sent() - inter0;
        intra_sent[rank] = groups.intra_node->bytes_sent() - intra0;
        results[rank] = x.floats();
      });
      for (int r = 0; r < world; ++r) {
        for (int64_t i = 0; i < n; ++i)
          ASSERT_TRUE(testing::same_bits(results[r][i], expect[i]))
              << v.name << " " << nodes << "x" << local << " n=" << n << " step " << step
              << " rank " << r << " element " << i << ": " << results[r][i] << " vs " << expect[i];
        if (step == 0) continue;  // the first step also compares layouts
        EXPECT_EQ(inter_sent[r], inter_node_bytes_sent(v.config, n, nodes, local)) << v.name;
        EXPECT_EQ(intra_sent[r], intra_node_bytes_sent(n, DType::kFloat32, local)) << v.name;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Grids, HierarchicalEquality,
                         ::testing::Combine(::testing::Values(2), ::testing::Values(2, 4),
                                            ::testing::Range(0, 5)));
INSTANTIATE_TEST_SUITE_P(Edges, HierarchicalEquality,
                         ::testing::Combine(::testing::Values(1, 3, 4), ::testing::Values(1, 3),
                                            ::testing::Values(0, 2, 4)));

TEST(Hierarchical, OneRankPerNodeIsTheFlatSchemeByteForByte) {
  for (const Variant& v : variants()) {
    const int world = 3;
    testing::NodeGrid grid(world, 1);
    InProcessGroup flat_group(world);
    std::vector<std::vector<uint8_t>> hier_out(world), flat_out(world);
    std::vector<CompressionState> hier_state(world), flat_state(world);
    std::vector<uint64_t> hier_sent(world), flat_sent(world);
    auto input = [](int rank, uint32_t step) {
      return HostTensor::from_floats(DType::kBFloat16,
                                     testing::normal_floats(900, 7 * step + rank));
    };
    testing::run_grid(grid, [&](int rank, NodeGroups groups) {
      auto backend = make_cpu_backend();
      CompressedAllreduce a(groups, *backend, v.config);
      EXPECT_EQ(a.local_world_size(), 1);
      for (uint32_t step = 0; step < 3; ++step, a.advance_step()) {
        HostTensor x = input(rank, step);
        Segment seg = x.segment();
        a.allreduce(&seg, 1, DType::kBFloat16, 5);
        hier_out[rank].insert(hier_out[rank].end(), x.bytes.begin(), x.bytes.end());
      }
      hier_state[rank] = a.state();
      hier_sent[rank] = groups.inter_node->bytes_sent() + groups.intra_node->bytes_sent();
    });
    run_ranks(flat_group, [&](int rank, Communicator& comm) {
      auto backend = make_cpu_backend();
      CompressedAllreduce a(comm, *backend, v.config);
      for (uint32_t step = 0; step < 3; ++step, a.advance_step()) {
        HostTensor x = input(rank, step);
        Segment seg = x.segment();
        a.allreduce(&seg, 1, DType::kBFloat16, 5);
        flat_out[rank].insert(flat_out[rank].end(), x.bytes.begin(), x.bytes.end());
      }
      flat_state[rank] = a.state();
      flat_sent[rank] = comm.bytes_sent();
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(hier_out[r], flat_out[r]) << v.name << " rank " << r;
      EXPECT_EQ(hier_state[r].residuals, flat_state[r].residuals) << v.name;
      EXPECT_EQ(hier_state[r].chunk_residuals, flat_state[r].chunk_residuals) << v.name;
      EXPECT_EQ(hier_sent[r], flat_sent[r]) << v.name;
    }
  }
}

TEST(Hierarchical, InterNodeBytesAreAnLthOfTheFlatSchemes) {
  CompressionConfig c;
  const int64_t n = 25 * 1000 * 1000;
  for (int local : {2, 4, 8}) {
    for (int nodes : {2, 4}) {
      const double flat = compressed_allreduce_bytes_sent(c, n, nodes * local);
      const double hier = inter_node_bytes_sent(c, n, nodes, local);
      // Per node: L ranks each send their shard's exchange; flat, L ranks each send the whole
      // bucket's (a world of nodes * L: nearly all of it leaves the node).
      EXPECT_NEAR(hier / flat,
                  1.0 / local * (nodes - 1) / nodes * (nodes * local) / (nodes * local - 1), 0.01)
          << nodes << "x" << local;
    }
  }
}

TEST(Hierarchical, LayoutMismatchAcrossNodesNamesTheRanksOnEveryRank) {
  // Rank 3 (node 1, local rank 1) differs: inside node 1 first; rank 1 only across nodes.
  for (int odd : {3, 1}) {
    testing::NodeGrid grid(2, 2, 5.0);
    std::vector<std::string> errors;
    const auto start = std::chrono::steady_clock::now();
    testing::run_grid(
        grid,
        [&](int rank, NodeGroups groups) {
          auto backend = make_cpu_backend();
          CompressedAllreduce engine(groups, *backend, CompressionConfig{});
          HostTensor x(DType::kFloat32, rank == odd ? 1064 : 1000);
          Segment seg = x.segment();
          engine.allreduce(&seg, 1, DType::kFloat32, 0);
        },
        &errors);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
    expect_layout_mismatch_on_every_rank(errors, 4, odd);
  }
}

// A NaN in one rank's bucket lands in one shard; the scan of the gathered bucket makes every
// rank of every node report it and keep its residuals, as the flat scheme does.
TEST(Hierarchical, NonFiniteInOneShardReachesEveryRankAndKeepsEveryResidual) {
  for (const Variant& v : variants()) {
    testing::NodeGrid grid(2, 2);
    std::vector<int> finite(4, -1);
    std::vector<char> any_nonfinite(4), state_kept(4);  // not vector<bool>: ranks write at once
    testing::run_grid(grid, [&](int rank, NodeGroups groups) {
      auto backend = make_cpu_backend();
      CompressedAllreduce engine(groups, *backend, v.config);
      for (int64_t n : {1000, 1001}) {  // in place, and through the padded buffer
        HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, rank));
        Segment seg = x.segment();
        ASSERT_TRUE(engine.allreduce(&seg, 1, DType::kFloat32, 3 + n));
        const CompressionState before = engine.state();
        engine.advance_step();
        x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 10 + rank));
        if (rank == 3) x.set(7, std::nanf(""));  // shard 0: reduced by local rank 0 only
        seg = x.segment();
        const bool ok = engine.allreduce(&seg, 1, DType::kFloat32, 3 + n);
        finite[rank] = finite[rank] == 1 || ok ? 1 : 0;
        bool bad = false;
        for (float f : x.floats()) bad |= !std::isfinite(f);
        any_nonfinite[rank] = bad;
        const CompressionState after = engine.state();
        state_kept[rank] =
            after.residuals == before.residuals && after.chunk_residuals == before.chunk_residuals;
        if (!state_kept[rank]) break;
      }
    });
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(finite[r], 0) << v.name << " rank " << r;
      EXPECT_TRUE(any_nonfinite[r]) << v.name << " rank " << r;
      EXPECT_TRUE(state_kept[r]) << v.name << " rank " << r;
    }
  }
}

// Bad bytes reach only the ranks of one exchange between nodes (local rank 1 on each node). The
// other local ranks accepted their own exchange's payloads; the node agrees before its allgather,
// so they raise at once too (not at the transport's timeout), no bucket is written, and the
// retried step computes what a fault-free run does.
TEST(Hierarchical, BadBytesInOneExchangeBetweenNodesStopEveryRankAtOnceAndARetryIsExact) {
  std::vector<Variant> cases = variants();
  cases[0].config.piece_numel = 0;  // q4 two-phase in one piece; cases[4]: many pieces
  for (const Variant& v : cases) {
    for (int64_t n : {4000, 4099}) {  // in place, and through the padded buffer
      const int nodes = 2, local = 2, world = nodes * local;
      const int64_t shard = node_shard_numel(n, local);
      const bool two_phase =
          v.config.codec == Codec::kQ4 && v.config.q4_algorithm == Q4Algorithm::kTwoPhase;
      // all_gathers between nodes per step (one per piece), after step 0's layout check: the
      // damaged one is step 1's middle one (a last piece may be empty on rank 1: all padding).
      const uint64_t per_step = two_phase ? q4_pieces(v.config, shard, nodes) : 1;
      auto run = [&](bool damage, std::vector<std::string>* errors, std::vector<char>* untouched,
                     std::chrono::steady_clock::duration* took) {
        testing::NodeGrid grid(nodes, local, 30.0);
        std::vector<std::vector<float>> out(world);
        const auto start = std::chrono::steady_clock::now();
        testing::run_grid(grid, [&](int rank, NodeGroups groups) {
          FaultSpec spec;
          spec.action =
              damage && rank % local == 1 ? FaultSpec::Action::kFlipBits : FaultSpec::Action::kNone;
          spec.call = 1 + per_step + per_step / 2;
          spec.rank = 1;
          FaultInjectingCommunicator inter(*groups.inter_node, spec);
          auto backend = make_cpu_backend();
          CompressedAllreduce engine(NodeGroups{groups.intra_node, &inter}, *backend, v.config);
          for (uint32_t step = 0; step < 3; ++step) {
            engine.set_step(step);
            HostTensor x = step_inputs(world, n, step)[rank];
            Segment seg = x.segment();
            try {
              engine.allreduce(&seg, 1, DType::kFloat32, 5);
            } catch (const Error& e) {
              (*errors)[rank] = e.what();
              (*untouched)[rank] = x.floats() == step_inputs(world, n, step)[rank].floats();
              if (rank == 0) *took = std::chrono::steady_clock::now() - start;
              engine.allreduce(&seg, 1, DType::kFloat32, 5);
            }
            const std::vector<float> f = x.floats();
            out[rank].insert(out[rank].end(), f.begin(), f.end());
          }
        });
        return out;
      };
      std::vector<std::string> errors(world), none(world);
      std::vector<char> untouched(world), unused(world);
      std::chrono::steady_clock::duration took{}, unused_took{};
      const auto expect = run(false, &none, &unused, &unused_took);
      const auto got = run(true, &errors, &untouched, &took);
      const std::string where = std::string(v.name) + " n=" + std::to_string(n);
      EXPECT_LT(took, std::chrono::seconds(10)) << where;
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(none[r].empty()) << where << ": " << none[r];
        EXPECT_TRUE(untouched[r]) << where << " rank " << r << ": the refused bucket was written";
        EXPECT_EQ(got[r], expect[r]) << where << " rank " << r;
        if (r % local == 1) {
          EXPECT_NE(errors[r].find("in the exchange between nodes, whose rank i is global rank "
                                   "2 i + 1"),
                    std::string::npos)
              << where << ": " << errors[r];
          EXPECT_NE(errors[r].find("(from rank 1) rejected"), std::string::npos) << errors[r];
        } else {
          const std::string named = "rank " + std::to_string(r + 1) + " (local rank 1 of node " +
                                    std::to_string(r / local) + ") rejected a payload";
          EXPECT_NE(errors[r].find(named), std::string::npos) << where << ": " << errors[r];
        }
      }
    }
  }
}

TEST(Hierarchical, CheckpointResumeIsBitIdenticalAndKeepsShardResiduals) {
  for (const Variant& v : variants()) {
    testing::NodeGrid grid(2, 2);
    const int world = 4;
    std::vector<RoundTrip> trips(world);
    testing::run_grid(grid, [&](int rank, NodeGroups groups) {
      auto backend = make_cpu_backend();
      trips[rank] = checkpoint_round_trip(
          [&] { return std::make_unique<CompressedAllreduce>(groups, *backend, v.config); }, rank,
          701);
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(trips[r].uninterrupted, trips[r].resumed) << v.name << " rank " << r;
      EXPECT_EQ(trips[r].saved.residuals.at(11).size(),
                residual_bytes(v.config, node_shard_numel(701, 2)))
          << v.name;
    }
  }
}

TEST(Collectives, BytesFormulaIsAboutAnEighthOfFp32AtAnyWorldSize) {
  CompressionConfig c;
  const int64_t n = 25 * 1000 * 1000;
  for (int world : {2, 4, 8, 64}) {
    const double ring_fp32 = 2.0 * (world - 1) / world * n * 4;
    const double ratio = compressed_allreduce_bytes_sent(c, n, world) / ring_fp32;
    EXPECT_GT(ratio, 0.12);
    EXPECT_LT(ratio, 0.145) << world;  // 4.5 bits of 32 with block 64
  }
  const int64_t big = (int64_t{1} << 31) + 3;
  const int64_t chunk = ((big + 3) / 4 + 63) / 64 * 64;
  CompressionConfig one_piece = c;
  one_piece.piece_numel = 0;
  EXPECT_EQ(compressed_allreduce_bytes_sent(one_piece, big, 4),
            2 * 3 * q4_payload_bytes(chunk, 64));
  // In pieces: one payload per piece, rank and phase, each piece of whole blocks.
  const int pieces = q4_pieces(c, big, 4);
  const int64_t piece = q4_piece_size(c, big, 4);
  EXPECT_EQ(pieces, 1025);  // just over 2^29 elements per chunk, pieces of at most 2^21 / 4
  EXPECT_EQ(piece % 64, 0);
  EXPECT_GE(piece * pieces, chunk);
  EXPECT_LT(piece * (pieces - 1), chunk);
  EXPECT_EQ(compressed_allreduce_bytes_sent(c, big, 4),
            2 * 3 * uint64_t(pieces) * q4_payload_bytes(piece, 64));
  EXPECT_LT(compressed_allreduce_bytes_sent(c, big, 4),
            1.001 * compressed_allreduce_bytes_sent(one_piece, big, 4));
}

TEST(Collectives, LayoutMismatchNamesTheRanksInsteadOfHanging) {
  InProcessGroup group(3, 5.0);
  std::vector<std::string> errors;
  const auto start = std::chrono::steady_clock::now();
  run_ranks(
      group,
      [&](int rank, Communicator& comm) {
        auto backend = make_cpu_backend();
        CompressedAllreduce engine(comm, *backend, CompressionConfig{});
        HostTensor x(DType::kFloat32, rank == 2 ? 1064 : 1000);
        Segment seg = x.segment();
        engine.allreduce(&seg, 1, DType::kFloat32, 0);
      },
      &errors);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  expect_layout_mismatch_on_every_rank(errors, 3, 2);
}

TEST(Collectives, NonFiniteOnOneRankReachesEveryRankAndKeepsResiduals) {
  for (const Variant& v : variants()) {
    InProcessGroup group(2);
    std::vector<int> finite(2);
    std::vector<char> any_nonfinite(2), state_kept(2);  // not vector<bool>: ranks write at once
    run_ranks(group, [&](int rank, Communicator& comm) {
      auto backend = make_cpu_backend();
      CompressedAllreduce engine(comm, *backend, v.config);
      HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(500, rank));
      Segment seg = x.segment();
      ASSERT_TRUE(engine.allreduce(&seg, 1, DType::kFloat32, 3));
      const CompressionState before = engine.state();
      engine.advance_step();
      x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(500, 10 + rank));
      if (rank == 1) x.set(123, std::nanf(""));
      seg = x.segment();
      finite[rank] = engine.allreduce(&seg, 1, DType::kFloat32, 3);
      bool bad = false;
      for (float f : x.floats()) bad |= !std::isfinite(f);
      any_nonfinite[rank] = bad;
      const CompressionState after = engine.state();
      state_kept[rank] =
          after.residuals == before.residuals && after.chunk_residuals == before.chunk_residuals;
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_FALSE(finite[r]) << v.name << " rank " << r;
      EXPECT_TRUE(any_nonfinite[r]) << v.name << " rank " << r;
      EXPECT_TRUE(state_kept[r]) << v.name << " rank " << r;
    }
  }
}

// The queued API (what the DDP hook uses on CUDA) gives the same bytes and residuals as
// allreduce(), counts the non-finite buckets, and reports them through synchronize() or poll().
TEST(Collectives, QueuedReductionsEqualAllreduceAndCountNonFiniteBuckets) {
  for (const Variant& v : variants()) {
    InProcessGroup group(2);
    std::vector<char> same(2, 0);  // not vector<bool>: ranks write at once
    std::vector<uint64_t> counted(2, 0), polled(2, 0);
    run_ranks(group, [&](int rank, Communicator& comm) {
      auto backend_a = make_cpu_backend(), backend_b = make_cpu_backend();
      CompressedAllreduce direct(comm, *backend_a, v.config);
      CompressedAllreduce queued(comm, *backend_b, v.config);
      bool equal = true;
      for (uint32_t step = 0; step < 4; ++step) {
        for (uint64_t bucket = 0; bucket < 2; ++bucket) {
          auto values = testing::normal_floats(600, 10 * step + 3 * rank + bucket);
          if (step == 1 && bucket == 1 && rank == 0) values[5] = INFINITY;
          if (step == 2 && rank == 1) values[9] = std::nanf("");
          HostTensor x = HostTensor::from_floats(DType::kFloat32, values), y = x;
          Segment sx = x.segment(), sy = y.segment();
          direct.allreduce(&sx, 1, DType::kFloat32, bucket);
          queued.enqueue_allreduce(&sy, 1, DType::kFloat32, bucket);
          equal &= x.bytes == y.bytes;
        }
        direct.advance_step();
        queued.advance_step();
        if (step == 1) {
          ASSERT_TRUE(queued.poll(&polled[rank]));  // the CPU backend is never behind
        }
      }
      counted[rank] = queued.synchronize();
      const CompressionState a = direct.state(), b = queued.state();
      same[rank] = equal && a.residuals == b.residuals && a.chunk_residuals == b.chunk_residuals;
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(same[r]) << v.name << " rank " << r;
      EXPECT_EQ(polled[r], 1u) << v.name << " rank " << r << ": step 1 had one non-finite bucket";
      EXPECT_EQ(counted[r], 2u) << v.name << " rank " << r << ": step 2 had two";
    }
  }
}

TEST(Collectives, CheckpointResumeIsBitIdentical) {
  for (const Variant& v : variants()) {
    const int world = 3;
    InProcessGroup group(world);
    std::vector<RoundTrip> trips(world);
    run_ranks(group, [&](int rank, Communicator& comm) {
      auto backend = make_cpu_backend();
      trips[rank] = checkpoint_round_trip(
          [&] { return std::make_unique<CompressedAllreduce>(comm, *backend, v.config); }, rank,
          700);
    });
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(trips[r].uninterrupted, trips[r].resumed) << v.name << " rank " << r;
  }
}

TEST(Collectives, InProcessTransportRejectsUnequalSizes) {
  InProcessGroup group(2, 5.0);
  std::vector<std::string> errors;
  run_ranks(
      group,
      [&](int rank, Communicator& comm) {
        std::vector<uint8_t> send(rank == 0 ? 8 : 16), recv(64);
        comm.all_gather(send.data(), recv.data(), send.size());
      },
      &errors);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[0].find("posted"), std::string::npos);
}

}  // namespace
}  // namespace gradcomp
