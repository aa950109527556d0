// The README's C++ example: a model trained on 2+ ranks with q4-compressed gradient averaging.
//   torchrun --nproc-per-node 2 --no-python ./quickstart
#include <gradcomp/torch.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  auto group = gradcomp::process_group_from_env();  // torchrun's RANK, WORLD_SIZE, MASTER_*
  torch::nn::Sequential model(torch::nn::Linear(64, 32), torch::nn::ReLU(),
                              torch::nn::Linear(32, 10));
  gradcomp::GradSync sync(*model, group, gradcomp::Q4{});  // buckets, hooks, rank 0's weights
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));

  torch::manual_seed(group->getRank());  // each rank its own data
  for (int step = 0; step < 50; ++step) {
    const torch::Tensor x = torch::randn({32, 64}), y = x.slice(1, 0, 10).argmax(1);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();  // buckets compress
    sync.finish();                                                          // averaged .grad
    optimizer.step();
  }
  torch::save(sync, "quickstart.rank" + std::to_string(group->getRank()) + ".pt");  // per rank

  const gradcomp::GradSyncStats stats = sync.stats();
  std::printf("rank %d: %llu bytes sent, %.1fx less than an fp32 ring allreduce\n",
              group->getRank(), static_cast<unsigned long long>(stats.total.bytes_sent),
              double(stats.total.uncompressed_bytes) / double(stats.total.bytes_sent));
  return 0;
}
