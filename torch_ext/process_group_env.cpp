// c10d process groups for C++ programs: from torchrun's or Slurm's environment, and node groups
// split from one.
#include <atomic>
#include <cstdlib>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "gradcomp/torch.h"
#include "torch_compat.h"

#if defined(GRADCOMP_HAVE_CUDA) && defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace gradcomp {
namespace {

std::string env(const char* name, const char* fallback = nullptr) {
  const char* v = std::getenv(name);
  GRADCOMP_CHECK(v != nullptr || fallback != nullptr,
                 "process_group_from_env: " << name << " is not set (launch with torchrun)");
  return v != nullptr ? v : fallback;
}

// A process group of `backend` over `store`.
c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(c10::intrusive_ptr<c10d::Store> store,
                                                          int rank, int world,
                                                          const std::string& backend,
                                                          std::chrono::milliseconds timeout) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  torch_ext::compat::remember_store(group, store);
  if (backend == "gloo") {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    options->devices.push_back(ifname != nullptr && *ifname != '\0'
                                   ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
                                   : c10d::ProcessGroupGloo::createDefaultDevice());
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    return group;
  }
#if defined(GRADCOMP_HAVE_CUDA) && defined(USE_C10D_NCCL)
  if (backend == "nccl") {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
    return group;
  }
#endif
  GRADCOMP_CHECK(false, "gradcomp: process group backend '" << backend << "' is not available (gloo"
#if defined(GRADCOMP_HAVE_CUDA) && defined(USE_C10D_NCCL)
                                                            << ", nccl"
#endif
                                                            << ")");
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> process_group_from_env(const std::string& backend,
                                                              std::chrono::milliseconds timeout) {
  // torchrun's variables, or Slurm's under srun without torchrun.
  const LaunchEnv launch = launch_env();
  const int rank = launch.rank, world = launch.world_size;
  const std::string addr = launch.master_addr;
  c10d::TCPStoreOptions store_options;
  GRADCOMP_CHECK(launch.master_port < 65536,
                 "process_group_from_env: port " << launch.master_port << " is out of range");
  store_options.port = static_cast<uint16_t>(launch.master_port);
  // Under torchrun's agent the store server already runs in the agent; workers are its clients.
  const bool agent_store = env("TORCHELASTIC_USE_AGENT_STORE", "False") == "True";
  store_options.isServer = rank == 0 && !agent_store;
  store_options.numWorkers = world;
  store_options.timeout = timeout;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(addr, store_options);
  // Keys of one attempt stay apart from those of a restarted job on the same store.
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "gradcomp/" + env("TORCHELASTIC_RESTART_COUNT", "0"), tcp);

  return make_process_group(store, rank, world, backend, timeout);
}

NodeProcessGroups split_node_groups(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                    int local_world_size, const std::string& backend,
                                    std::chrono::milliseconds timeout) {
  GRADCOMP_CHECK(group, "split_node_groups: no process group");
  const int world = group->getSize(), rank = group->getRank();
  int local = local_world_size;
  if (local == 0) {
    try {
      local =
          launch_env().local_world_size;  // torchrun's LOCAL_WORLD_SIZE, or Slurm's tasks per node
    } catch (const Error&) {
      local = 1;  // a group made without a launcher's environment: one node
    }
    if (local <= 0 || local >= world) local = 1;
  }
  GRADCOMP_CHECK(local >= 1 && world % local == 0,
                 "split_node_groups: " << local << " ranks per node do not divide the world of "
                                       << world << " ranks: every node must hold as many");
  if (local == 1) return {};
  const int node = rank / local, local_rank = rank % local;
  auto store = torch_ext::compat::store_of(group);
  GRADCOMP_CHECK(store,
                 "split_node_groups: the process group shows no store on this torch (2.7 "
                 "has no ProcessGroup::getStore): make it with process_group_from_env, or "
                 "pass the node groups yourself (GradSyncOptions::node_groups)");
  // Each call's groups rendezvous under keys of their own (every rank calls in the same order),
  // so a second split never reads the first one's entries.
  static std::atomic<uint64_t> calls{0};
  const std::string split = "gradcomp-split-" + std::to_string(calls++) + "/";
  NodeProcessGroups groups;
  groups.intra_node = make_process_group(
      c10::make_intrusive<c10d::PrefixStore>(split + "node-" + std::to_string(node), store),
      local_rank, local, backend, timeout);
  groups.inter_node = make_process_group(
      c10::make_intrusive<c10d::PrefixStore>(split + "cross-" + std::to_string(local_rank), store),
      node, world / local, backend, timeout);
  return groups;
}

}  // namespace gradcomp
