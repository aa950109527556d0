// Data-parallel training of an MLP on scikit-learn's digits from C++, with gradcomp::GradSync.
//
//   python examples/cpp/make_digits.py digits.bin
//   torchrun --nproc-per-node 2 --no-python ./digits_trainer --data digits.bin --codec q4
//
// --codec q4 | topk | topk-q4warmup (q4 for the first --q4-warmup steps, then top-k) | topk-dgc
// (top-k with DGC's momentum correction, clipping and warm-up; the optimizer is then SGD without
// momentum) | none (GradSync without compression) | allreduce (no gradcomp: one blocking allreduce
// per gradient after backward, what C++ programs do without it). --local-world-size L: L ranks
// per node, uncompressed inside a node and compressed between nodes. --piece-numel N: the
// pipeline's pieces and the overlap of consecutive buckets (0: each bucket whole, one after
// another). --worker-cpus auto | inherit | LIST: where the thread compressing the buckets runs.
// --diloco H: no GradSync; every rank trains alone and every H steps gradcomp::DiLoCo averages
// the q4 outer gradient (--fragments F: streaming; --overlap-steps T, --mixing A, --eager:
// Streaming DiLoCo's overlap; --outer-lr, --outer-momentum). --optimizer adamw: AdamW instead of
// SGD. The other flags serve the tests and benchmarks: checkpoints, gradient dumps, no_sync
// accumulation, unused parameters, step timing.
#include <gradcomp/torch.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace {

struct Flags {
  std::map<std::string, std::string> values;
  std::string get(const std::string& k, const std::string& fallback) const {
    auto it = values.find(k);
    return it == values.end() ? fallback : it->second;
  }
  int64_t num(const std::string& k, int64_t fallback) const {
    return std::stoll(get(k, std::to_string(fallback)));
  }
  double real(const std::string& k, double fallback) const {
    return std::stod(get(k, std::to_string(fallback)));
  }
  bool has(const std::string& k) const { return values.count(k) != 0; }
};

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) throw std::runtime_error("unexpected argument " + k);
    k = k.substr(2);
    const bool boolean = i + 1 >= argc || std::string(argv[i + 1]).rfind("--", 0) == 0;
    f.values[k] = boolean ? "1" : argv[++i];
  }
  return f;
}

struct Digits {
  torch::Tensor train_x, train_y, test_x, test_y;
};

Digits load_digits(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path + " (make it with make_digits.py)");
  char magic[4];
  uint32_t counts[3];
  in.read(magic, 4);
  in.read(reinterpret_cast<char*>(counts), sizeof counts);
  if (std::string(magic, 4) != "DIGT") throw std::runtime_error(path + " is not a digits file");
  auto read = [&](int64_t rows, torch::Tensor& x, torch::Tensor& y) {
    x = torch::empty({rows, counts[2]}, torch::kFloat);
    torch::Tensor labels = torch::empty({rows}, torch::kInt);
    in.read(reinterpret_cast<char*>(x.data_ptr<float>()), x.numel() * 4);
    in.read(reinterpret_cast<char*>(labels.data_ptr<int32_t>()), rows * 4);
    y = labels.to(torch::kLong);
  };
  Digits d;
  read(counts[0], d.train_x, d.train_y);
  read(counts[1], d.test_x, d.test_y);
  if (!in) throw std::runtime_error(path + " is truncated");
  return d;
}

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t hidden, bool unused) {
    fc1 = register_module("fc1", torch::nn::Linear(64, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 10));
    // A parameter that no step uses, for the unused-parameter tests.
    if (unused) spare = register_parameter("spare", torch::zeros({7}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor spare;
};
TORCH_MODULE(Mlp);

// Every parameter as float32, concatenated in registration order.
torch::Tensor flat(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> parts;
  for (const auto& t : tensors) parts.push_back(t.detach().to(torch::kFloat).reshape({-1}));
  return torch::cat(parts);
}

std::vector<torch::Tensor> grads(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> g;
  for (const auto& p : params) g.push_back(p.grad().defined() ? p.grad() : torch::zeros_like(p));
  return g;
}

void write_floats(std::ofstream& out, const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kFloat).cpu().contiguous();
  out.write(reinterpret_cast<const char*>(c.data_ptr<float>()), c.numel() * 4);
}

gradcomp::CodecSpec codec_spec(const Flags& f) {
  const std::string codec = f.get("codec", "q4");
  const uint64_t seed = static_cast<uint64_t>(f.num("codec-seed", 0));
  if (codec == "q4") {
    gradcomp::Q4 q4;
    q4.seed = seed;
    q4.piece_numel = f.num("piece-numel", q4.piece_numel);
    return q4;
  }
  if (codec == "topk") {
    gradcomp::TopK topk;
    topk.ratio = f.real("ratio", 0.01);
    topk.seed = seed;
    topk.piece_numel = f.num("piece-numel", topk.piece_numel);
    return topk;
  }
  if (codec == "topk-q4warmup") {
    // q4 for the first --q4-warmup steps, then top-k (with Adam-family optimizers: prefer q4).
    gradcomp::TopK topk;
    topk.ratio = f.real("ratio", 0.01);
    topk.seed = seed;
    topk.piece_numel = f.num("piece-numel", topk.piece_numel);
    topk.warmup = gradcomp::TopKWarmup::kQ4;
    topk.warmup_steps = static_cast<uint32_t>(f.num("q4-warmup", 2));
    return topk;
  }
  if (codec == "topk-dgc") {
    gradcomp::TopK topk;
    topk.ratio = f.real("ratio", 0.01);
    topk.seed = seed;
    topk.piece_numel = f.num("piece-numel", topk.piece_numel);
    topk.momentum = 0.9f;
    topk.clip_norm = static_cast<float>(f.real("clip-norm", 5.0));
    topk.warmup_steps = static_cast<uint32_t>(f.num("sparsity-warmup", 2));
    return topk;
  }
  if (codec == "none") return gradcomp::NoCompression{};
  throw std::runtime_error("unknown codec " + codec);
}

std::string rank_path(const std::string& base, int rank) {
  return base + ".rank" + std::to_string(rank);
}

int run(const Flags& f) {
  // --device cuda: one GPU per process (LOCAL_RANK) and NCCL; otherwise CPU and Gloo.
  // --backend gloo with CUDA: more ranks than GPUs share them in turn (NCCL refuses that).
  const bool cuda = f.get("device", "cpu") == "cuda";
  auto group = gradcomp::process_group_from_env(f.get("backend", cuda ? "nccl" : "gloo"),
                                                std::chrono::seconds(f.num("timeout", 60)));
  const int rank = group->getRank(), world = group->getSize();
  const char* local_rank = std::getenv("LOCAL_RANK");
  const int gpus = cuda ? static_cast<int>(torch::cuda::device_count()) : 1;
  const torch::Device device =
      cuda ? torch::Device(torch::kCUDA,
                           (local_rank ? std::atoi(local_rank) : 0) % std::max(gpus, 1))
           : torch::kCPU;
  const Digits data = load_digits(f.get("data", "digits.bin"));
  const torch::Tensor rows = torch::arange(rank, data.train_x.size(0), world);
  const torch::Tensor x = data.train_x.index_select(0, rows).to(device);
  const torch::Tensor y = data.train_y.index_select(0, rows).to(device);

  const int64_t seed = f.num("seed", 0);
  torch::manual_seed(seed);
  // --hidden-on-rank R:H gives rank R another model, for the mismatch test.
  int64_t hidden = f.num("hidden", 32);
  const std::string other = f.get("hidden-on-rank", "");
  if (!other.empty() && std::stoi(other.substr(0, other.find(':'))) == rank)
    hidden = std::stoll(other.substr(other.find(':') + 1));
  Mlp model(hidden, f.has("unused"));
  const torch::Dtype dtype =
      f.get("dtype", "float32") == "bfloat16" ? torch::kBFloat16 : torch::kFloat;
  model->to(device, dtype);
  // Parameters load before the GradSync is made: loading replaces their tensors' storage.
  const std::string resume = f.has("resume") ? rank_path(f.get("resume", ""), rank) : "";
  if (!resume.empty()) torch::load(model, resume + ".model");
  const std::vector<torch::Tensor> params = model->parameters();

  const int64_t batch = f.num("batch", 32);
  const int64_t per_epoch = x.size(0) / batch;
  const int64_t total = f.has("steps") ? f.num("steps", 0) : f.num("epochs", 30) * per_epoch;

  const std::string codec = f.get("codec", "q4");
  if (!resume.empty() && codec == "allreduce") throw std::runtime_error("--resume needs GradSync");
  std::unique_ptr<gradcomp::GradSync> sync;
  std::unique_ptr<gradcomp::DiLoCo> diloco;
  if (f.has("diloco")) {
    gradcomp::DiLoCoOptions o;
    o.outer.inner_steps = static_cast<uint32_t>(f.num("diloco", 100));
    o.outer.fragments = static_cast<uint32_t>(f.num("fragments", 1));
    o.outer.overlap_steps = static_cast<uint32_t>(f.num("overlap-steps", 0));
    o.outer.mixing = static_cast<float>(f.real("mixing", 0.0));
    o.outer.eager = f.has("eager");
    if (f.has("outer-lr")) o.outer.outer_lr = static_cast<float>(f.real("outer-lr", 0.0));
    if (f.has("outer-momentum"))
      o.outer.outer_momentum = static_cast<float>(f.real("outer-momentum", 0.0));
    o.planned_steps = static_cast<uint64_t>(total);  // for DiLoCo's short-run warning
    // Mid-round each rank's parameters are its own: a resumed run keeps what it loaded.
    o.broadcast_parameters = resume.empty();
    diloco = std::make_unique<gradcomp::DiLoCo>(params, group, codec_spec(f), o);
  } else if (codec != "allreduce") {
    gradcomp::GradSyncOptions o;
    o.find_unused_parameters = f.has("find-unused");
    o.bucket_cap_bytes = static_cast<int64_t>(f.real("bucket-cap-mb", 25.0) * (1 << 20));
    o.first_bucket_cap_bytes = static_cast<int64_t>(f.real("first-bucket-cap-mb", 1.0) * (1 << 20));
    // Ranks per node for the hierarchical scheme (0: torchrun's LOCAL_WORLD_SIZE; 1: flat).
    o.local_world_size = static_cast<int>(f.num("local-world-size", 1));
    o.worker_cpus = f.get("worker-cpus", "auto");
    sync = std::make_unique<gradcomp::GradSync>(*model, group, codec_spec(f), o);
  } else {
    for (const auto& p : params) {  // the same start on every rank, as GradSync does
      std::vector<torch::Tensor> t = {p.detach()};
      group->broadcast(t)->wait();
    }
  }
  if (f.has("reload-after-sync")) {  // the mistake GradSync must name: loading after making it
    const std::string tmp = rank_path(f.get("reload-after-sync", ""), rank);
    torch::save(model, tmp);
    torch::load(model, tmp);
  }
  const double lr = f.real("lr", 0.05);
  // Momentum correction applies the momentum in GradSync: the optimizer then has none.
  const bool dgc = codec == "topk-dgc";
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (f.get("optimizer", "sgd") == "adamw") {
    optimizer = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr));
  } else {
    optimizer = std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(lr).momentum(dgc ? 0.0 : 0.9));
  }
  torch::optim::Optimizer& opt = *optimizer;
  if (sync) gradcomp::check_optimizer(opt, codec_spec(f));

  const int64_t accumulate = f.num("accumulate", 1);
  int64_t start = 0;
  if (f.has("resume")) {
    torch::load(opt, resume + ".opt");
    if (sync) torch::load(*sync, resume + ".sync");
    if (diloco) torch::load(*diloco, resume + ".diloco");
    torch::Tensor step;
    torch::load(step, resume + ".step");
    start = step.item<int64_t>();
  }
  std::ofstream dump;
  if (f.has("dump")) dump.open(rank_path(f.get("dump", ""), rank), std::ios::binary);
  const int64_t save_at = f.num("save-at", -1), nan_at = f.num("nan-at", -1);
  const int64_t warmup = f.num("warmup", 5);
  std::vector<double> step_ms;
  gradcomp::GradSyncStats timed;

  for (int64_t s = start; s < total; ++s) {
    if (s == save_at) {
      const std::string base = rank_path(f.get("save", "checkpoint"), rank);
      torch::save(model, base + ".model");
      torch::save(opt, base + ".opt");
      if (sync) torch::save(*sync, base + ".sync");
      if (diloco) torch::save(*diloco, base + ".diloco");
      torch::save(torch::tensor(s), base + ".step");
      if (f.has("stop-at-save")) break;
    }
    for (auto& group_of : opt.param_groups())  // steps at 60% and 85% of the run, x 0.1 each
      group_of.options().set_lr(lr * (s >= 0.85 * total ? 0.01 : (s >= 0.6 * total ? 0.1 : 1.0)));
    // The order of an epoch is a function of the epoch alone, so a resumed run sees the same.
    const int64_t epoch = s / per_epoch, i = s % per_epoch;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1000 * rank + 7919 * epoch);
    const torch::Tensor perm = torch::randperm(x.size(0), gen);
    const torch::Tensor idx = perm.slice(0, i * batch, (i + 1) * batch).to(device);
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    const int64_t micro = idx.size(0) / accumulate;
    for (int64_t m = 0; m < accumulate; ++m) {
      const torch::Tensor part = idx.slice(0, m * micro, (m + 1) * micro);
      auto loss = torch::nn::functional::cross_entropy(
          model->forward(x.index_select(0, part).to(dtype)).to(torch::kFloat),
          y.index_select(0, part));
      if (s == nan_at && rank == 0 && m + 1 == accumulate) loss = loss * std::nanf("");
      if (sync && m + 1 < accumulate) {
        auto guard = sync->no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    if (dump.is_open()) write_floats(dump, flat(grads(params)));
    if (sync) {
      sync->finish();
    } else if (!diloco) {
      for (auto& g : grads(params)) {
        g.div_(world);
        std::vector<torch::Tensor> t = {g};
        group->allreduce(t)->wait();
      }
    }
    if (dump.is_open()) write_floats(dump, flat(grads(params)));
    opt.step();
    if (diloco) diloco->step();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s - start >= warmup) {
      step_ms.push_back(ms);
      if (sync) {
        const gradcomp::GradSyncStats st = sync->stats();
        timed.backward_seconds += st.backward_seconds;
        timed.reduction_seconds += st.reduction_seconds;
        timed.overlapped_seconds += st.overlapped_seconds;
        timed.finish_wait_seconds += st.finish_wait_seconds;
      }
    }
    // --metrics-dir: this rank's counters for node_exporter's textfile collector, every step.
    if (sync && f.has("metrics-dir"))
      sync->write_metrics(f.get("metrics-dir", "") + "/gradcomp-rank" + std::to_string(rank) +
                          ".prom");
    if (s == nan_at && sync)
      std::printf("rank %d step %lld nonfinite_buckets %llu\n", rank, static_cast<long long>(s),
                  static_cast<unsigned long long>(sync->stats().step.nonfinite_buckets));
  }

  if (diloco) diloco->flush();  // the round still in flight, with --overlap-steps
  torch::NoGradGuard no_grad;
  const double accuracy = model->forward(data.test_x.to(device, dtype))
                              .argmax(1)
                              .eq(data.test_y.to(device))
                              .to(torch::kFloat)
                              .mean()
                              .item<double>();
  if (f.has("params-out")) {
    std::ofstream out(rank_path(f.get("params-out", ""), rank), std::ios::binary);
    write_floats(out, flat(params));
  }
  if (f.has("layout-out") && sync && rank == 0) {
    std::ofstream out(f.get("layout-out", ""));
    out << "{\"buckets\": [";
    const auto buckets = sync->buckets();
    for (size_t b = 0; b < buckets.size(); ++b) {
      out << (b ? ", " : "") << "[";
      for (size_t k = 0; k < buckets[b].size(); ++k) out << (k ? ", " : "") << buckets[b][k];
      out << "]";
    }
    out << "], \"shapes\": [";
    for (size_t p = 0; p < params.size(); ++p) {
      out << (p ? ", " : "") << "[";
      for (int64_t d = 0; d < params[p].dim(); ++d) out << (d ? ", " : "") << params[p].size(d);
      out << "]";
    }
    out << "]}\n";
  }
  std::sort(step_ms.begin(), step_ms.end());
  const double median = step_ms.empty() ? 0.0 : step_ms[step_ms.size() / 2];
  const double n = step_ms.empty() ? 1.0 : static_cast<double>(step_ms.size());
  gradcomp::ReductionStats total_stats;
  std::string worker_cpus;  // the worker's CPUs, as "0,1"
  if (sync) {
    total_stats = sync->stats().total;
    for (int c : sync->worker_cpus())
      worker_cpus += (worker_cpus.empty() ? "" : ",") + std::to_string(c);
  }
  if (diloco) {
    const gradcomp::OuterSyncStats d = diloco->stats();
    total_stats.bytes_sent = d.bytes_sent;
    total_stats.uncompressed_bytes = d.uncompressed_bytes;
    total_stats.steps = d.rounds;
  }
  std::printf(
      "{\"rank\": %d, \"world\": %d, \"codec\": \"%s\", \"worker_cpus\": \"%s\", "
      "\"accuracy\": %.6f, \"steps\": %lld, "
      "\"step_ms\": %.4f, \"bytes_sent\": %llu, \"inter_node_bytes\": %llu, "
      "\"uncompressed_bytes\": %llu, \"outer_rounds\": %llu, "
      "\"backward_ms\": %.4f, \"reduction_ms\": %.4f, \"overlapped_ms\": %.4f, \"finish_wait_ms\": "
      "%.4f}\n",
      rank, world, codec.c_str(), worker_cpus.c_str(), accuracy,
      static_cast<long long>(step_ms.size()), median,
      static_cast<unsigned long long>(total_stats.bytes_sent),
      static_cast<unsigned long long>(total_stats.inter_node_bytes),
      static_cast<unsigned long long>(total_stats.uncompressed_bytes),
      static_cast<unsigned long long>(diloco ? total_stats.steps : 0),
      1e3 * timed.backward_seconds / n, 1e3 * timed.reduction_seconds / n,
      1e3 * timed.overlapped_seconds / n, 1e3 * timed.finish_wait_seconds / n);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "digits_trainer: %s\n", e.what());
    return 1;
  }
}
