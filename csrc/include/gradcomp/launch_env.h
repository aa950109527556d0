// Where this process sits in the job, from the launcher's environment: torchrun's variables, or
// Slurm's when a job is started by srun without torchrun.
#pragma once

#include <functional>
#include <string>

namespace gradcomp {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  // the rendezvous host (rank 0's)
  int master_port = 29500;
  std::string launcher;  // "torchrun" or "slurm"
};

// torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT when
// RANK is set; otherwise Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the tasks of this node
// (SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE at SLURM_NODEID) and the first host of
// SLURM_JOB_NODELIST (or SLURM_NODELIST). MASTER_ADDR and MASTER_PORT override Slurm's host and
// the port, which is otherwise 20000 + SLURM_JOB_ID % 10000, so that two jobs sharing a node
// do not meet on one port. Throws Error naming the variable that is missing or malformed.
using EnvLookup = std::function<const char*(const char*)>;
LaunchEnv launch_env(const EnvLookup& lookup);
LaunchEnv launch_env();  // the process's environment

// The first host of a Slurm host list: "node[07-09,12],gpu3" -> "node07".
std::string slurm_first_host(const std::string& nodelist);
// The task count of node `node` in a SLURM_TASKS_PER_NODE value: "2(x3),1" -> 2 for nodes 0-2, 1
// for 3.
int slurm_tasks_on_node(const std::string& tasks_per_node, int node);

}  // namespace gradcomp
