// The shared-memory transport: the in-process transport's results byte for byte (pieces larger
// than a slot included), real processes, and a missing peer named instead of a hang.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/collectives.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/shm_communicator.h"
#include "run_ranks.h"
#include "test_util.h"

namespace gradcomp {
namespace {

std::string unique_name(const char* what) {
  static std::atomic<int> counter{0};
  return "/gradcomp-test-" + std::string(what) + "-" + std::to_string(getpid()) + "-" +
         std::to_string(counter++);
}

// Runs fn(rank, comm) for every rank on threads, once over shared memory (slots of
// `slot_bytes`) and once in process; returns both ranks' outputs.
using Body = std::function<std::vector<uint8_t>(int, Communicator&)>;
void compare_with_inprocess(int world, size_t slot_bytes, const Body& body, const char* what) {
  const std::string name = unique_name(what);
  std::vector<std::vector<uint8_t>> shm_out(world), ref_out(world);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ShmCommunicator comm(name, r, world, 10.0, slot_bytes);
        shm_out[r] = body(r, comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << what << " rank " << r;
  InProcessGroup group(world);
  testing::run_ranks(group, [&](int r, Communicator& comm) { ref_out[r] = body(r, comm); });
  for (int r = 0; r < world; ++r) EXPECT_EQ(shm_out[r], ref_out[r]) << what << " rank " << r;
}

std::vector<uint8_t> bytes_of(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST(ShmCommunicator, EveryCollectiveEqualsTheInProcessTransportInPiecesLargerThanASlot) {
  for (int world : {1, 2, 3, 4}) {
    for (size_t slot : {size_t{256}, size_t{1} << 20}) {
      compare_with_inprocess(
          world, slot,
          [&](int r, Communicator& c) {
            std::vector<float> send = testing::normal_floats(777, r), recv(777 * world);
            c.all_gather(send.data(), recv.data(), send.size() * 4);
            return bytes_of(recv);
          },
          "all_gather");
      compare_with_inprocess(
          world, slot,
          [&](int r, Communicator& c) {
            std::vector<float> send = testing::normal_floats(301 * world, r), recv(301 * world);
            c.all_to_all(send.data(), recv.data(), 301 * 4);
            return bytes_of(recv);
          },
          "all_to_all");
      compare_with_inprocess(
          world, slot,
          [&](int r, Communicator& c) {
            std::vector<float> send = testing::normal_floats(513 * world, r), recv(513);
            c.reduce_scatter_mean(send.data(), recv.data(), 513, DType::kFloat32);
            return bytes_of(recv);
          },
          "reduce_scatter");
      compare_with_inprocess(
          world, slot,
          [&](int r, Communicator& c) {
            testing::HostTensor x =
                testing::HostTensor::from_floats(DType::kBFloat16, testing::normal_floats(999, r));
            c.allreduce_mean(x.bytes.data(), 999, DType::kBFloat16);
            return x.bytes;
          },
          "allreduce");
    }
  }
}

// One piece of every rank's shard, reduced and gathered where it lies (a stride between the
// ranks' slices): the packed calls' results on both transports (the in-process one packs through
// Communicator's default), and the strided bytes outside the slices are left alone.
TEST(ShmCommunicator, StridedCollectivesEqualThePackedOnes) {
  for (int world : {1, 2, 3}) {
    for (size_t slot : {size_t{256}, size_t{1} << 20}) {
      const int64_t n = 301, stride = 517;  // slice of n elements every `stride`
      compare_with_inprocess(
          world, slot,
          [&](int r, Communicator& c) {
            const std::vector<float> spread = testing::normal_floats(stride * world, r);
            std::vector<float> packed(n * world), strided(n), whole(n);
            for (int w = 0; w < world; ++w)
              std::copy_n(spread.begin() + stride * w, n, packed.begin() + n * w);
            c.reduce_scatter_mean(packed.data(), whole.data(), n, DType::kFloat32);
            c.reduce_scatter_mean_strided(spread.data(), stride, strided.data(), n,
                                          DType::kFloat32);
            EXPECT_EQ(bytes_of(strided), bytes_of(whole)) << "reduce_scatter rank " << r;
            return bytes_of(strided);
          },
          "reduce_scatter_strided");
      compare_with_inprocess(
          world, slot,
          [&](int r, Communicator& c) {
            const std::vector<float> send = testing::normal_floats(n, r);
            std::vector<float> packed(n * world), spread(stride * world, -1.0f);
            c.all_gather(send.data(), packed.data(), n * 4);
            c.all_gather_strided(send.data(), spread.data(), n * 4, stride * 4);
            for (int w = 0; w < world; ++w) {
              for (int64_t i = 0; i < stride; ++i) {
                const float want = i < n ? packed[n * w + i] : -1.0f;
                EXPECT_TRUE(testing::same_bits(spread[stride * w + i], want))
                    << "all_gather rank " << r << " slice " << w << " element " << i;
              }
            }
            return bytes_of(spread);
          },
          "all_gather_strided");
    }
  }
}

TEST(ShmCommunicator, StridedCollectivesRefuseAStrideShorterThanASlice) {
  InProcessGroup group(1);
  Communicator& c = group.communicator(0);
  std::vector<float> a(10), b(10);
  EXPECT_THROW(c.reduce_scatter_mean_strided(a.data(), 4, b.data(), 5, DType::kFloat32), Error);
  EXPECT_THROW(c.all_gather_strided(a.data(), b.data(), 20, 16), Error);
}

TEST(ShmCommunicator, CountsBytesAsTheFormulasSay) {
  const std::string name = unique_name("bytes");
  std::vector<std::thread> threads;
  std::vector<uint64_t> sent(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ShmCommunicator comm(name, r, 2, 10.0);
      std::vector<float> send(2000), recv(1000);
      comm.reduce_scatter_mean(send.data(), recv.data(), 1000, DType::kFloat32);
      sent[r] = comm.bytes_sent();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(sent[0], reduce_scatter_bytes(1000, DType::kFloat32, 2));
  EXPECT_EQ(sent[1], sent[0]);
}

// Real processes: a hierarchical allreduce whose intra-node groups are shared memory equals the
// one over in-process groups on the same inputs.
TEST(ShmCommunicator, WorksAcrossProcesses) {
  const std::string name = unique_name("fork");
  const int world = 3;
  std::vector<pid_t> children;
  for (int r = 1; r < world; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 0;
      try {
        ShmCommunicator comm(name, r, world, 20.0, 4096);
        std::vector<float> send = testing::normal_floats(5000 * world, r), recv(5000);
        comm.reduce_scatter_mean(send.data(), recv.data(), 5000, DType::kFloat32);
        std::vector<float> all(5000 * world);
        comm.all_gather(recv.data(), all.data(), 5000 * 4);
      } catch (...) {
        code = 1;
      }
      _exit(code);
    }
    children.push_back(pid);
  }
  ShmCommunicator comm(name, 0, world, 20.0, 4096);
  std::vector<float> send = testing::normal_floats(5000 * world, 0), recv(5000);
  comm.reduce_scatter_mean(send.data(), recv.data(), 5000, DType::kFloat32);
  std::vector<float> all(5000 * world);
  comm.all_gather(recv.data(), all.data(), 5000 * 4);
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  // Element i of shard 0: the rank-order fp32 mean of every rank's element i.
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < world; ++r) inputs.push_back(testing::normal_floats(5000 * world, r));
  for (int64_t i = 0; i < 5000; i += 97) {
    float sum = 0.0f;
    for (int r = 0; r < world; ++r) sum = math::add_rn(sum, math::mul_rn(inputs[r][i], 1.0f / 3));
    ASSERT_TRUE(testing::same_bits(all[i], sum)) << i;
  }
}

// A hierarchical allreduce with shared-memory node groups equals the one with in-process node
// groups, byte for byte (the two transports round the node mean alike).
// In pieces (piece_numel 512), the node's reduce-scatter and allgather run piece by piece, strided.
class ShmNodeGroup : public ::testing::TestWithParam<int64_t> {};

TEST_P(ShmNodeGroup, AsTheIntraNodeGroupOfAHierarchicalAllreduce) {
  const int nodes = 2, local = 2, world = 4;
  CompressionConfig config;
  config.seed = 9;
  config.piece_numel = GetParam();
  std::vector<std::vector<uint8_t>> with_shm(world), in_process(world);
  const std::string names[2] = {unique_name("node0"), unique_name("node1")};
  for (bool shm : {true, false}) {
    testing::NodeGrid grid(nodes, local);
    testing::run_grid(grid, [&](int rank, NodeGroups groups) {
      std::unique_ptr<ShmCommunicator> intra;
      if (shm) {
        intra =
            std::make_unique<ShmCommunicator>(names[rank / local], rank % local, local, 10.0, 4096);
        groups.intra_node = intra.get();
      }
      auto backend = make_cpu_backend();
      CompressedAllreduce a(groups, *backend, config);
      std::vector<uint8_t>& out = shm ? with_shm[rank] : in_process[rank];
      for (uint32_t step = 0; step < 3; ++step, a.advance_step()) {
        testing::HostTensor x = testing::HostTensor::from_floats(
            DType::kFloat32, testing::normal_floats(5003, 10 * step + rank));
        Segment seg = x.segment();
        ASSERT_TRUE(a.allreduce(&seg, 1, DType::kFloat32, 4));
        out.insert(out.end(), x.bytes.begin(), x.bytes.end());
      }
    });
  }
  for (int r = 0; r < world; ++r) EXPECT_EQ(with_shm[r], in_process[r]) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(OneAndManyPieces, ShmNodeGroup,
                         ::testing::Values(int64_t{0}, CompressionConfig::kDefaultPieceNumel,
                                           int64_t{512}));

TEST(ShmCommunicator, AMissingPeerIsNamedAndTheOthersGiveUpToo) {
  const std::string name = unique_name("missing");
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  std::atomic<int> attached{0};
  for (int r = 0; r < 3; ++r) {
    if (r == 2) continue;  // never comes: the others time out attaching
    threads.emplace_back([&, r] {
      try {
        ShmCommunicator comm(name, r, 3, 1.0);
        attached++;
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  }
  const auto start = std::chrono::steady_clock::now();
  for (auto& t : threads) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(attached.load(), 0);
  for (const auto& e : errors) {
    EXPECT_TRUE(e.find("only 2 of 3 ranks arrived") != std::string::npos ||
                e.find("gave up") != std::string::npos)
        << e;
  }
  // The name did not outlive the failed group: a new group of that name can be made.
  std::vector<std::thread> again;
  for (int r = 0; r < 2; ++r) again.emplace_back([&, r] { ShmCommunicator c(name, r, 2, 5.0); });
  for (auto& t : again) t.join();
}

TEST(ShmCommunicator, RefusesBadArguments) {
  EXPECT_THROW(ShmCommunicator("no-slash", 0, 1), Error);
  EXPECT_THROW(ShmCommunicator("/a", 2, 2), Error);
  EXPECT_THROW(ShmCommunicator("/a", 0, 2, 1.0, 16), Error);
}

}  // namespace
}  // namespace gradcomp
