// The C++ front ends' threads under ThreadSanitizer: ranks in processes of their own on Gloo, each
// step watched by a metrics scraper on another thread (issue 34 item 7).
//
//   gradcomp_torch_front_end_threads [world] [scenario...]   (exits 0 when every rank passed)
//
// Scenarios: grad_sync, ddp_hook, diloco, fsdp (all when none is named). Each rank runs them in
// order on one process group; every step of every front end runs while a second thread reads its
// stats() / metrics_text() as fast as it can, as a Prometheus scrape or a Python monitoring thread
// does while the GIL is released. Under TSan (build-tsan, halt_on_error=1) a race ends the rank.
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <vector>

#include "ddp_hook.h"
#include "fsdp_collectives.h"
#include "gradcomp/torch.h"

namespace {

using gradcomp::ReductionStats;

#define EXPECT_THAT(cond, what)                                                        \
  do {                                                                                 \
    if (!(cond)) throw std::runtime_error(std::string(what) + " (failed: " #cond ")"); \
  } while (0)

// Reads a front end's counters in a loop on its own thread until stopped, checking that what it
// sees only grows.
class Scraper {
 public:
  // `read` returns a counter that may only grow (steps, rounds, buckets).
  explicit Scraper(std::function<uint64_t()> read)
      : thread_([this, read = std::move(read)] {
          while (!stop_.load()) {
            const uint64_t seen = read();
            if (seen < last_) went_back_ = true;
            last_ = seen;
            ++reads_;
            std::this_thread::yield();
          }
        }) {}
  ~Scraper() { stop(); }
  // Joins the thread; returns how many reads it made.
  uint64_t stop() {
    if (thread_.joinable()) {
      stop_ = true;
      thread_.join();
    }
    EXPECT_THAT(!went_back_, "a scraped counter went back");
    return reads_;
  }

 private:
  std::atomic<bool> stop_{false};
  uint64_t last_ = 0, reads_ = 0;
  bool went_back_ = false;
  std::thread thread_;  // last: starts after the fields above exist
};

// Every metrics_text holds its front end's counters; this one's value, as a sanity check on what
// the scraper read.
uint64_t metric(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + "{");
  EXPECT_THAT(at != std::string::npos, name + " missing from metrics_text");
  const size_t value = text.find("} ", at);
  return std::strtoull(text.c_str() + value + 2, nullptr, 10);
}

torch::nn::Sequential small_model() {
  return torch::nn::Sequential(torch::nn::Linear(64, 48), torch::nn::ReLU(),
                               torch::nn::Linear(48, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 10));
}

torch::Tensor loss_of(torch::nn::Sequential& model) {
  const torch::Tensor x = torch::randn({16, 64}), y = x.slice(1, 0, 10).argmax(1);
  return torch::nn::functional::cross_entropy(model->forward(x), y);
}

// Every rank holds the same tensor (what each front end promises after its reduction).
void expect_same_on_every_rank(c10d::ProcessGroup& group, const torch::Tensor& t,
                               const std::string& what) {
  std::vector<torch::Tensor> mine{t.detach().clone()}, lowest{t.detach().clone()};
  group.allreduce(mine, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
  group.allreduce(lowest, c10d::AllreduceOptions{c10d::ReduceOp::MIN})->wait();
  EXPECT_THAT(torch::equal(mine[0], lowest[0]), what + " differs between ranks");
}

// GradSync, q4, four buckets: backward hands buckets to the engine's worker while the scraper
// reads stats() and metrics_text().
void grad_sync(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  auto model = small_model();
  gradcomp::GradSyncOptions options;
  options.bucket_cap_bytes = 4096;
  options.first_bucket_cap_bytes = 1024;
  gradcomp::GradSync sync(*model, group, gradcomp::Q4{}, options);
  EXPECT_THAT(sync.buckets().size() >= 3, "GradSync made fewer than 3 buckets");
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
  const int steps = 4;
  Scraper scraper([&] {
    const uint64_t buckets = metric(sync.metrics_text(), "gradcomp_buckets_total");
    return std::max(buckets, sync.stats().total.buckets);
  });
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    loss_of(model).backward();
    sync.finish();
    for (const auto& p : model->parameters()) expect_same_on_every_rank(*group, p.grad(), "grad");
    optimizer.step();
  }
  EXPECT_THAT(scraper.stop() > 0, "the scraper never ran");
  const gradcomp::GradSyncStats s = sync.stats();
  EXPECT_THAT(s.total.steps == steps, "GradSync counted " + std::to_string(s.total.steps));
  EXPECT_THAT(s.total.buckets == steps * sync.buckets().size(), "GradSync bucket count");
}

// The DDP hook's native object, as DDP's reducer drives it: GradcompCommHook::runHook with each
// bucket in index order (reduced on the engine's worker), futures waited for by the caller.
void ddp_hook(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  using namespace gradcomp::torch_ext;
  const std::vector<std::vector<torch::Tensor>> bucket_params{
      {torch::zeros({20, 50})}, {torch::zeros({777})}, {torch::zeros({8, 4}), torch::zeros({32})}};
  std::vector<at::Tensor> params;
  for (const auto& in_bucket : bucket_params)
    params.insert(params.end(), in_bucket.begin(), in_bucket.end());
  auto hook = std::make_shared<DdpHook>(group, ddp_engine_options(gradcomp::Q4{}));
  hook->set_parameters(params);
  GradcompCommHook comm_hook(hook);
  const int steps = 4;
  Scraper scraper([&] {
    const std::string text = gradcomp::prometheus_text(
        hook->engine().total_stats(), gradcomp::metric_labels(group->getRank(), "q4", "ddp"));
    hook->engine().last_step_stats();
    return metric(text, "gradcomp_buckets_total");
  });
  for (int step = 0; step < steps; ++step) {
    std::vector<torch::Tensor> buffers;
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (size_t b = 0; b < bucket_params.size(); ++b) {
      std::vector<size_t> offsets, lengths;
      std::vector<c10::IntArrayRef> shapes;
      size_t numel = 0;
      for (const torch::Tensor& p : bucket_params[b]) {
        offsets.push_back(numel);
        lengths.push_back(static_cast<size_t>(p.numel()));
        shapes.push_back(p.sizes());
        numel += static_cast<size_t>(p.numel());
      }
      buffers.push_back(torch::randn({static_cast<int64_t>(numel)}));
      c10d::GradBucket bucket(b, bucket_params.size(), buffers[b], offsets, lengths, shapes,
                              bucket_params[b], std::nullopt);
      futures.push_back(comm_hook.runHook(bucket));
    }
    for (size_t b = 0; b < futures.size(); ++b) {
      futures[b]->wait();
      EXPECT_THAT(!futures[b]->hasError(), futures[b]->tryRetrieveErrorMessage());
      EXPECT_THAT(comm_hook.parseHookResult(futures[b]->value()).is_same(buffers[b]),
                  "the hook's result is not the bucket's buffer");
    }
    // Only now: the group's collectives must not interleave with the worker's.
    for (const torch::Tensor& buffer : buffers)
      expect_same_on_every_rank(*group, buffer, "DDP bucket");
  }
  EXPECT_THAT(scraper.stop() > 0, "the scraper never ran");
  const ReductionStats s = hook->engine().total_stats();
  EXPECT_THAT(s.buckets == steps * bucket_params.size(), "DDP hook bucket count");
}

// DiLoCo with its rounds in the background (overlap_steps = 1) over two fragments: the round's
// thread, the training thread and the scraper all touch the outer state's counters.
void diloco(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  auto model = small_model();
  gradcomp::DiLoCoOptions options;
  options.outer.inner_steps = 4;
  options.outer.fragments = 2;
  options.outer.overlap_steps = 1;
  options.outer.mixing = 0.5f;
  gradcomp::DiLoCo diloco(*model, group, gradcomp::Q4{}, options);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
  const int steps = 8;
  Scraper scraper([&] {
    const uint64_t rounds = metric(diloco.metrics_text(), "gradcomp_buckets_total");
    return std::max(rounds, diloco.stats().rounds);
  });
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    loss_of(model).backward();
    optimizer.step();
    diloco.step();
  }
  diloco.flush();
  EXPECT_THAT(scraper.stop() > 0, "the scraper never ran");
  const gradcomp::OuterSyncStats s = diloco.stats();
  EXPECT_THAT(s.inner_steps == steps, "DiLoCo counted " + std::to_string(s.inner_steps));
  // H = 4 over 2 fragments: one fragment's round starts every second inner step.
  EXPECT_THAT(s.rounds == steps / 2, "DiLoCo rounds: " + std::to_string(s.rounds));
}

// FSDP2's collectives (the Python front end's native objects): the reduce-scatter, the replica
// all-reduce and the int8 all-gather, each scraped while it runs.
void fsdp(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  using namespace gradcomp::torch_ext;
  const int world = group->getSize();
  const gradcomp::CompressionConfig q4 = gradcomp::engine_options(gradcomp::Q4{}).config;
  const std::chrono::milliseconds timeout(0);
  FsdpReduceScatter reduce_scatter(group, q4, timeout);
  FsdpReplicaAllreduce allreduce(group, q4, timeout);
  FsdpAllGather all_gather(group, gradcomp::AllGatherOptions{}, timeout);
  const std::vector<FsdpCollective*> all{&reduce_scatter, &allreduce, &all_gather};
  Scraper scraper([&] {
    ReductionStats total;
    for (FsdpCollective* c : all) {
      total.add(c->total_stats());
      c->step_stats();
    }
    return metric(gradcomp::prometheus_text(total, gradcomp::metric_labels(0, "q4", "fsdp")),
                  "gradcomp_buckets_total");
  });
  const int steps = 3, shard = 500;
  for (int step = 0; step < steps; ++step) {
    for (uint64_t bucket = 0; bucket < 2; ++bucket) {
      const torch::Tensor full = torch::randn({world * shard}), out = torch::empty({shard});
      reduce_scatter.reduce_scatter(out, full, bucket, world);
      const torch::Tensor replica = torch::randn({shard});
      allreduce.allreduce(replica, bucket);
      expect_same_on_every_rank(*group, replica, "replica all-reduce");
      const torch::Tensor mine = torch::randn({shard}), gathered = torch::empty({world * shard});
      all_gather.all_gather(gathered, mine, {{gradcomp::DType::kFloat32, shard}}, bucket, "w",
                            false);
      expect_same_on_every_rank(*group, gathered, "all-gathered weights");
    }
  }
  EXPECT_THAT(scraper.stop() > 0, "the scraper never ran");
  EXPECT_THAT(reduce_scatter.total_stats().buckets == 2 * steps, "reduce-scatter bucket count");
  EXPECT_THAT(allreduce.total_stats().buckets == 2 * steps, "all-reduce bucket count");
}

const std::map<std::string, void (*)(const c10::intrusive_ptr<c10d::ProcessGroup>&)> kScenarios{
    {"grad_sync", grad_sync}, {"ddp_hook", ddp_hook}, {"diloco", diloco}, {"fsdp", fsdp}};

int run_rank(int rank, int world, const std::string& store_path,
             const std::vector<std::string>& scenarios) {
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  torch::manual_seed(1000 + rank);  // each rank its own data
  for (const std::string& name : scenarios) {
    const auto start = std::chrono::steady_clock::now();
    try {
      kScenarios.at(name)(group);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s FAILED: %s\n", rank, name.c_str(), e.what());
      return 1;
    }
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank %d: %s passed (%.1f s)\n", rank, name.c_str(), took);
    std::fflush(stdout);
  }
  return 0;
}

// Starts `world` ranks as fresh processes of this program (exec, not a bare fork: ThreadSanitizer
// cannot follow threads across a fork); when one fails the others are stopped.
int spawn_ranks(const char* self, int world, const std::vector<std::string>& scenarios) {
  char dir[] = "/tmp/gradcomp-tsan-XXXXXX";
  if (mkdtemp(dir) == nullptr) return 2;
  const std::string store = std::string(dir) + "/store";
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    std::vector<std::string> args{self, "--rank", std::to_string(rank), std::to_string(world),
                                  store};
    args.insert(args.end(), scenarios.begin(), scenarios.end());
    const pid_t pid = fork();
    if (pid == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv("/proc/self/exe", argv.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (size_t left = pids.size(); left > 0; --left) {
    int status = 0;
    const pid_t pid = wait(&status);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    std::fprintf(stderr, "rank process %d ended with %s %d\n", pid,
                 WIFEXITED(status) ? "exit status" : "signal",
                 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    if (!failed)
      for (pid_t other : pids)
        if (other != pid) kill(other, SIGTERM);
    failed = 1;
  }
  std::remove(store.c_str());
  rmdir(dir);
  return failed;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 5 && std::string(argv[1]) == "--rank")
    return run_rank(std::atoi(argv[2]), std::atoi(argv[3]), argv[4],
                    std::vector<std::string>(argv + 5, argv + argc));
  int world = 2, first = 1;
  if (argc > 1 && std::isdigit(static_cast<unsigned char>(argv[1][0])))
    world = std::atoi(argv[first++]);
  std::vector<std::string> scenarios(argv + first, argv + argc);
  for (const std::string& name : scenarios)
    if (!kScenarios.count(name)) {
      std::fprintf(stderr, "unknown scenario %s (grad_sync, ddp_hook, diloco, fsdp)\n",
                   name.c_str());
      return 2;
    }
  if (scenarios.empty())
    for (const auto& kv : {"grad_sync", "ddp_hook", "diloco", "fsdp"}) scenarios.push_back(kv);
  return spawn_ranks(argv[0], world, scenarios);
}
