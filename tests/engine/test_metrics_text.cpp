// Metrics: the engine's counters (steps, latency, failures, rejected payloads, residual memory)
// and their Prometheus text, and the atomic file write of the textfile collector.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/engine.h"
#include "gradcomp/fault_injection.h"
#include "gradcomp/inprocess_group.h"
#include "test_util.h"

namespace gradcomp {
namespace {

// sample line (name{labels}) -> value
std::map<std::string, std::string> samples(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = line.substr(space + 1);
  }
  return out;
}

TEST(MetricsText, EveryCounterIsExportedWithItsLabelsAndExactValues) {
  ReductionStats s;
  s.steps = 7;
  s.buckets = 21;
  s.compressed_buckets = 21;
  s.bytes_sent = 123456789012ull;
  s.uncompressed_bytes = 987654321098ull;
  s.codec_seconds = 0.1;
  s.comm_seconds = 2.5;
  s.nonfinite_buckets = 1;
  s.rejected_payloads = 2;
  s.failed_buckets = 3;
  s.failed_steps = 1;
  s.residual_bytes = 4096;
  s.observe_latency(0.0002);  // <= 0.00025
  s.observe_latency(0.0002);
  s.observe_latency(20.0);  // above every bound
  MetricLabels l{3, 1, "node\"a", "q4", "ddp"};
  const std::string text = prometheus_text(s, l);
  const std::string labels =
      "{rank=\"3\",local_rank=\"1\",node=\"node\\\"a\",codec=\"q4\",front_end=\"ddp\"}";
  auto m = samples(text);
  EXPECT_EQ(m["gradcomp_steps_total" + labels], "7");
  EXPECT_EQ(m["gradcomp_sent_bytes_total" + labels], "123456789012");
  EXPECT_EQ(m["gradcomp_uncompressed_bytes_total" + labels], "987654321098");
  EXPECT_EQ(std::stod(m["gradcomp_compression_ratio" + labels]), 987654321098.0 / 123456789012.0);
  EXPECT_EQ(m["gradcomp_codec_seconds_total" + labels], "0.1");
  EXPECT_EQ(m["gradcomp_communication_seconds_total" + labels], "2.5");
  EXPECT_EQ(m["gradcomp_rejected_payloads_total" + labels], "2");
  EXPECT_EQ(m["gradcomp_failed_buckets_total" + labels], "3");
  EXPECT_EQ(m["gradcomp_failed_steps_total" + labels], "1");
  EXPECT_EQ(m["gradcomp_nonfinite_buckets_total" + labels], "1");
  EXPECT_EQ(m["gradcomp_residual_bytes" + labels], "4096");
  const std::string at = labels.substr(0, labels.size() - 1);
  EXPECT_EQ(m["gradcomp_bucket_seconds_bucket" + at + ",le=\"0.0001\"}"], "0");
  EXPECT_EQ(m["gradcomp_bucket_seconds_bucket" + at + ",le=\"0.00025\"}"], "2");
  EXPECT_EQ(m["gradcomp_bucket_seconds_bucket" + at + ",le=\"10\"}"], "2");
  EXPECT_EQ(m["gradcomp_bucket_seconds_bucket" + at + ",le=\"+Inf\"}"], "3");
  EXPECT_EQ(m["gradcomp_bucket_seconds_count" + labels], "3");
  EXPECT_EQ(std::stod(m["gradcomp_bucket_seconds_sum" + labels]), 0.0002 + 0.0002 + 20.0);
  // One HELP and one TYPE per family.
  EXPECT_NE(text.find("# TYPE gradcomp_bucket_seconds histogram\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE gradcomp_sent_bytes_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE gradcomp_residual_bytes gauge\n"), std::string::npos);
}

TEST(MetricsText, WeightAllGathersAreSeriesOfTheirOwnBesideTheGradients) {
  ReductionStats gradients;
  gradients.steps = 4;
  gradients.buckets = 12;
  gradients.bytes_sent = 1000;
  gradients.uncompressed_bytes = 7500;
  gradients.codec_seconds = 0.5;
  ReductionStats weights;
  weights.steps = 9;  // not exported: steps are the gradients'
  weights.buckets = 24;
  weights.bytes_sent = 3000;
  weights.uncompressed_bytes = 11000;
  weights.codec_seconds = 0.25;
  weights.comm_seconds = 1.5;
  weights.failed_buckets = 2;
  MetricLabels l{1, 0, "n", "q4", "fsdp"};
  const std::string labels =
      "{rank=\"1\",local_rank=\"0\",node=\"n\",codec=\"q4\",front_end=\"fsdp\"}";
  const std::string text = prometheus_text(gradients, weights, l);
  // The gradient series are exactly those of the gradients alone, first.
  const std::string alone = prometheus_text(gradients, l);
  ASSERT_EQ(text.substr(0, alone.size()), alone);
  auto m = samples(text);
  EXPECT_EQ(m["gradcomp_steps_total" + labels], "4");
  EXPECT_EQ(m["gradcomp_sent_bytes_total" + labels], "1000");
  EXPECT_EQ(m["gradcomp_uncompressed_bytes_total" + labels], "7500");
  EXPECT_EQ(std::stod(m["gradcomp_compression_ratio" + labels]), 7.5);
  EXPECT_EQ(m["gradcomp_weight_all_gathers_total" + labels], "24");
  EXPECT_EQ(m["gradcomp_weight_sent_bytes_total" + labels], "3000");
  EXPECT_EQ(m["gradcomp_weight_uncompressed_bytes_total" + labels], "11000");
  EXPECT_EQ(std::stod(m["gradcomp_weight_compression_ratio" + labels]), 11000.0 / 3000.0);
  EXPECT_EQ(m["gradcomp_weight_codec_seconds_total" + labels], "0.25");
  EXPECT_EQ(m["gradcomp_weight_communication_seconds_total" + labels], "1.5");
  EXPECT_EQ(m["gradcomp_weight_failed_all_gathers_total" + labels], "2");
  EXPECT_EQ(text.find("gradcomp_weight_steps"), std::string::npos);
  EXPECT_NE(text.find("# TYPE gradcomp_weight_sent_bytes_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE gradcomp_weight_compression_ratio gauge\n"), std::string::npos);
  // Before any all-gather: every weight series present, zero (a ratio of 0, not a division by 0).
  auto zero = samples(prometheus_text(gradients, ReductionStats{}, l));
  EXPECT_EQ(zero["gradcomp_weight_sent_bytes_total" + labels], "0");
  EXPECT_EQ(zero["gradcomp_weight_compression_ratio" + labels], "0");
  // One family per name: no series twice.
  std::istringstream in(text);
  std::map<std::string, int> types;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# TYPE ", 0) == 0) ++types[line.substr(7, line.find(' ', 7) - 7)];
  }
  for (const auto& [name, count] : types) EXPECT_EQ(count, 1) << name;
}

TEST(MetricsText, TheFileIsReplacedWholeAndAnUnwritablePathIsNamed) {
  const std::string path = ::testing::TempDir() + "gradcomp_metrics_test.prom";
  write_file_atomically(path, "first\n");
  write_file_atomically(path, "second\n");
  std::ifstream f(path);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(all, "second\n");
  EXPECT_FALSE(std::ifstream(path + ".tmp").good());  // no temporary left behind
  std::remove(path.c_str());
  try {
    write_file_atomically("/nonexistent-dir/x.prom", "x");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/x.prom"), std::string::npos);
  }
}

std::string read_all(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A fresh directory of the test's own, and the names in it.
std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    out.push_back(e.path().filename().string());
  return out;
}

TEST(MetricsText, TwoConcurrentWritersNeverLeaveAMixedOrTornFile) {
  const std::string dir = fresh_dir("gradcomp_two_writers");
  const std::string path = dir + "/m.prom";
  // Big enough that a shared temporary would be written by both at once.
  const std::string a(1 << 18, 'a'), b(1 << 17, 'b');
  std::atomic<int> errors{0};
  auto writer = [&](const std::string& text) {
    for (int i = 0; i < 100; ++i) {
      try {
        write_file_atomically(path, text);
      } catch (const Error&) {
        ++errors;
      }
    }
  };
  std::thread t1(writer, a), t2(writer, b);
  // Every version a reader sees is one writer's whole text.
  for (int i = 0; i < 200; ++i) {
    const std::string seen = read_all(path);
    EXPECT_TRUE(seen.empty() || seen == a || seen == b)
        << "a reader saw " << seen.size() << " bytes";
  }
  t1.join();
  t2.join();
  EXPECT_EQ(errors.load(), 0);
  const std::string last = read_all(path);
  EXPECT_TRUE(last == a || last == b) << last.size() << " bytes";
  EXPECT_EQ(names_in(dir), std::vector<std::string>{"m.prom"}) << "a temporary was left behind";
  std::filesystem::remove_all(dir);
}

TEST(MetricsText, ALinkPlantedAtTheTemporarysNameIsNotWrittenThrough) {
  const std::string dir = fresh_dir("gradcomp_planted_link");
  const std::string path = dir + "/m.prom";
  const std::string victim = dir + "/victim";
  std::ofstream(victim) << "precious\n";
  // The names a writer could be expected to use: the old fixed one and this process's first.
  std::filesystem::create_symlink(victim, path + ".tmp");
  write_file_atomically(path, "metrics\n");
  EXPECT_EQ(read_all(victim), "precious\n") << "the write followed the planted link";
  EXPECT_EQ(read_all(path), "metrics\n");
  EXPECT_FALSE(std::filesystem::is_symlink(path));
  std::filesystem::remove_all(dir);
}

TEST(EngineCounters, StepsLatencyResidualsAndARejectedPayloadAreCounted) {
  constexpr int kWorld = 2;
  InProcessGroup group(kWorld);
  std::vector<ReductionStats> totals(kWorld);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      FaultSpec spec;
      spec.action = FaultSpec::Action::kFlipBits;
      spec.collective = "all_gather";
      spec.call = 3;  // step 2's allgather (after the layout check and steps 0 and 1)
      spec.rank = 1;
      FaultInjectingCommunicator comm(group.communicator(rank), spec);
      auto backend = make_cpu_backend();
      EngineOptions o;
      o.config.seed = 3;
      o.config.piece_numel = 0;
      BucketEngine engine(o);
      engine.bind(comm, backend.get());
      for (uint32_t step = 0; step < 4; ++step) {
        std::vector<float> g = testing::normal_floats(5000, step * 10 + rank);
        BucketRequest r;
        r.data = g.data();
        r.numel = 5000;
        r.index = 0;
        r.identity = 77;
        r.is_last = true;
        try {
          engine.reduce(r);
          EXPECT_NE(step, 2u) << "rank " << rank;
        } catch (const Error&) {
          EXPECT_EQ(step, 2u) << "rank " << rank;
        }
      }
      totals[rank] = engine.total_stats();
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < kWorld; ++rank) {
    const ReductionStats& s = totals[rank];
    EXPECT_EQ(s.steps, 4u);
    EXPECT_EQ(s.failed_buckets, 1u);
    EXPECT_EQ(s.failed_steps, 1u);
    EXPECT_EQ(s.rejected_payloads, 1u);
    uint64_t observed = 0;
    for (uint64_t c : s.latency_counts) observed += c;
    EXPECT_EQ(observed, s.buckets);
    EXPECT_EQ(s.buckets, 3u);  // the failed bucket is not a reduced one
    // Two-phase q4, fp32 residuals, both buffers: the bucket's and the own chunk's.
    EXPECT_EQ(s.residual_bytes, 2u * (5000 + 2560) * 4);
  }
}

}  // namespace
}  // namespace gradcomp
