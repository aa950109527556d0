// The C++ side of bench/e2e.py: step time of the benchmark's MLP with GradSync or with the
// per-tensor blocking allreduce C++ programs write without gradcomp. One process per rank, with
// RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (by e2e.py or torchrun).
//   throughput --method gradsync-q4|gradsync-topk|gradsync-none|allreduce --hidden 4096
//              --steps 20 --warmup 3 --out result.json
#include <gradcomp/torch.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

// Bytes sent over this network namespace's loopback so far (all ranks share it).
uint64_t loopback_tx_bytes() {
  std::ifstream f("/proc/net/dev");
  for (std::string line; std::getline(f, line);) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name != "lo") continue;
    std::istringstream fields(line.substr(colon + 1));
    uint64_t v = 0;
    for (int i = 0; i < 9; ++i) fields >> v;  // the ninth field is transmitted bytes
    return v;
  }
  return 0;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string arg(int argc, char** argv, const std::string& key, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == "--" + key) return argv[i + 1];
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string method = arg(argc, argv, "method", "gradsync-q4");
  const int64_t hidden = std::stoll(arg(argc, argv, "hidden", "4096"));
  const int steps = std::stoi(arg(argc, argv, "steps", "20"));
  const int warmup = std::stoi(arg(argc, argv, "warmup", "3"));
  const int64_t batch = std::stoll(arg(argc, argv, "batch", "32"));
  const std::string out = arg(argc, argv, "out", "");
  try {
    auto group = gradcomp::process_group_from_env("gloo", std::chrono::seconds(300));
    const int world = group->getSize();
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(1024, hidden), torch::nn::ReLU(),
                                torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                                torch::nn::Linear(hidden, 1024));
    std::unique_ptr<gradcomp::GradSync> sync;
    if (method == "gradsync-q4") {
      sync = std::make_unique<gradcomp::GradSync>(*model, group, gradcomp::Q4{});
    } else if (method == "gradsync-topk") {
      sync = std::make_unique<gradcomp::GradSync>(*model, group, gradcomp::TopK{});
    } else if (method == "gradsync-none") {
      sync = std::make_unique<gradcomp::GradSync>(*model, group, gradcomp::NoCompression{});
    } else if (method != "allreduce") {
      throw std::runtime_error("unknown method " + method);
    }
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1e-3));
    const torch::Tensor x = torch::randn({batch, 1024});
    std::vector<double> times, codec, hidden_ms, wait_ms;
    uint64_t tx0 = 0;
    for (int step = 0; step < warmup + steps; ++step) {
      if (step == warmup) tx0 = loopback_tx_bytes();
      const auto t0 = std::chrono::steady_clock::now();
      opt.zero_grad();
      model->forward(x).square().mean().backward();
      if (sync) {
        sync->finish();
      } else {
        for (auto& p : model->parameters()) {
          p.grad().div_(world);
          std::vector<torch::Tensor> t = {p.grad()};
          group->allreduce(t)->wait();
        }
      }
      opt.step();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (step < warmup) continue;
      times.push_back(s);
      if (sync) {
        const gradcomp::GradSyncStats st = sync->stats();
        codec.push_back(st.step.codec_seconds);
        hidden_ms.push_back(1e3 * st.overlapped_seconds);
        wait_ms.push_back(1e3 * st.finish_wait_seconds);
      }
    }
    const double tx = static_cast<double>(loopback_tx_bytes() - tx0);
    int64_t params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
    std::ostringstream json;
    json << "{\"ok\": true, \"method\": \"cpp-" << method << "\", \"params\": " << params
         << ", \"step_s\": " << median(times) << ", \"step_times\": [";
    for (size_t i = 0; i < times.size(); ++i) json << (i ? ", " : "") << times[i];
    json << "], \"bytes_per_step_per_rank\": " << tx / steps / world << ", \"codec_s\": ";
    if (sync) {
      json << median(codec) << ", \"overlapped_ms\": " << median(hidden_ms)
           << ", \"finish_wait_ms\": " << median(wait_ms);
    } else {
      json << "null";
    }
    json << "}";
    if (group->getRank() == 0 && !out.empty()) std::ofstream(out) << json.str() << "\n";
    std::printf("%s\n", json.str().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "throughput: %s\n", e.what());
    return 1;
  }
}
