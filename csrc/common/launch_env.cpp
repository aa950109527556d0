// The job's layout from torchrun's or Slurm's environment variables.
#include "gradcomp/launch_env.h"

#include <cstdlib>

#include "gradcomp/types.h"

namespace gradcomp {
namespace {

int parse_count(const std::string& value, const char* name, int lo) {
  char* end = nullptr;
  const long x = std::strtol(value.c_str(), &end, 10);
  GRADCOMP_CHECK(
      !value.empty() && end != value.c_str() && *end == '\0' && x >= lo && x < (1L << 30),
      "launch environment: " << name << "='" << value << "' is not a number >= " << lo);
  return static_cast<int>(x);
}

struct Reader {
  const EnvLookup& lookup;
  const char* get(const char* name) const {
    const char* v = lookup(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  }
  std::string need(const char* name, const char* why) const {
    const char* v = get(name);
    GRADCOMP_CHECK(v != nullptr, "launch environment: " << name << " is not set (" << why << ")");
    return v;
  }
  int count(const char* name, const char* why, int lo) const {
    return parse_count(need(name, why), name, lo);
  }
};

}  // namespace

std::string slurm_first_host(const std::string& nodelist) {
  // The first entry ends at the first comma outside brackets; in it, each bracket range is
  // replaced by its first number, zero padding kept.
  std::string host;
  size_t i = 0;
  while (i < nodelist.size() && nodelist[i] != ',') {
    if (nodelist[i] != '[') {
      host += nodelist[i++];
      continue;
    }
    const size_t close = nodelist.find(']', i);
    GRADCOMP_CHECK(close != std::string::npos,
                   "launch environment: host list '" << nodelist << "' has an unclosed '['");
    const std::string inside = nodelist.substr(i + 1, close - i - 1);
    const std::string first = inside.substr(0, inside.find_first_of(",-"));
    GRADCOMP_CHECK(!first.empty() && first.find_first_not_of("0123456789") == std::string::npos,
                   "launch environment: host list '" << nodelist << "' has a range '[" << inside
                                                     << "]' that does not start with a number");
    host += first;
    i = close + 1;
  }
  GRADCOMP_CHECK(!host.empty(), "launch environment: host list '" << nodelist << "' names no host");
  return host;
}

int slurm_tasks_on_node(const std::string& tasks_per_node, int node) {
  // Comma-separated "N" or "N(xR)" entries, R consecutive nodes with N tasks each.
  int first_node = 0;
  size_t i = 0;
  while (i < tasks_per_node.size()) {
    size_t end = tasks_per_node.find(',', i);
    if (end == std::string::npos) end = tasks_per_node.size();
    const std::string entry = tasks_per_node.substr(i, end - i);
    const size_t paren = entry.find("(x");
    const int tasks = parse_count(entry.substr(0, paren), "SLURM_TASKS_PER_NODE", 1);
    int repeat = 1;
    if (paren != std::string::npos) {
      GRADCOMP_CHECK(entry.back() == ')', "launch environment: SLURM_TASKS_PER_NODE='"
                                              << tasks_per_node << "' has an unclosed '(x'");
      repeat =
          parse_count(entry.substr(paren + 2, entry.size() - paren - 3), "SLURM_TASKS_PER_NODE", 1);
    }
    if (node < first_node + repeat) return tasks;
    first_node += repeat;
    i = end + 1;
  }
  GRADCOMP_CHECK(false, "launch environment: SLURM_TASKS_PER_NODE='" << tasks_per_node
                                                                     << "' has no node " << node);
}

LaunchEnv launch_env(const EnvLookup& lookup) {
  const Reader env{lookup};
  LaunchEnv e;
  if (env.get("RANK") != nullptr) {
    const char* why = "torchrun sets it";
    e.launcher = "torchrun";
    e.rank = env.count("RANK", why, 0);
    e.world_size = env.count("WORLD_SIZE", why, 1);
    e.local_rank = env.get("LOCAL_RANK") ? env.count("LOCAL_RANK", why, 0) : 0;
    e.local_world_size = env.get("LOCAL_WORLD_SIZE") ? env.count("LOCAL_WORLD_SIZE", why, 1) : 1;
    e.master_addr = env.get("MASTER_ADDR") ? env.get("MASTER_ADDR") : "127.0.0.1";
    e.master_port = env.get("MASTER_PORT") ? env.count("MASTER_PORT", why, 1) : 29500;
  } else {
    const char* why = "launch with torchrun, or with srun inside a Slurm allocation";
    GRADCOMP_CHECK(
        env.get("SLURM_PROCID") != nullptr,
        "launch environment: neither RANK (torchrun) nor SLURM_PROCID (srun) is set: " << why);
    e.launcher = "slurm";
    e.rank = env.count("SLURM_PROCID", why, 0);
    e.world_size = env.count("SLURM_NTASKS", why, 1);
    e.local_rank = env.count("SLURM_LOCALID", why, 0);
    if (env.get("SLURM_NTASKS_PER_NODE") != nullptr) {
      e.local_world_size = env.count("SLURM_NTASKS_PER_NODE", why, 1);
    } else {
      e.local_world_size = slurm_tasks_on_node(env.need("SLURM_TASKS_PER_NODE", why),
                                               env.count("SLURM_NODEID", why, 0));
    }
    const char* nodes = env.get("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
    e.master_addr =
        env.get("MASTER_ADDR") ? env.get("MASTER_ADDR") : slurm_first_host(env.need(nodes, why));
    e.master_port = env.get("MASTER_PORT") ? env.count("MASTER_PORT", why, 1)
                    : env.get("SLURM_JOB_ID") != nullptr
                        ? 20000 + env.count("SLURM_JOB_ID", why, 0) % 10000
                        : 29500;
  }
  GRADCOMP_CHECK(e.rank < e.world_size, "launch environment (" << e.launcher << "): rank " << e.rank
                                                               << " >= world size "
                                                               << e.world_size);
  GRADCOMP_CHECK(e.local_rank < e.local_world_size,
                 "launch environment (" << e.launcher << "): local rank " << e.local_rank
                                        << " >= ranks on this node " << e.local_world_size);
  return e;
}

LaunchEnv launch_env() {
  return launch_env([](const char* name) { return std::getenv(name); });
}

}  // namespace gradcomp
