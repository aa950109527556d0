// The launch environment: torchrun's variables, Slurm's host lists and task counts, the errors.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "gradcomp/launch_env.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace {

LaunchEnv from(const std::map<std::string, std::string>& vars) {
  return launch_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    from(vars);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(LaunchEnv, TorchrunsVariablesWinOverSlurms) {
  const LaunchEnv e = from({{"RANK", "3"},
                            {"WORLD_SIZE", "8"},
                            {"LOCAL_RANK", "1"},
                            {"LOCAL_WORLD_SIZE", "2"},
                            {"MASTER_ADDR", "10.0.0.5"},
                            {"MASTER_PORT", "29511"},
                            {"SLURM_PROCID", "0"},
                            {"SLURM_NTASKS", "2"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "10.0.0.5");
  EXPECT_EQ(e.master_port, 29511);
}

TEST(LaunchEnv, SrunWithoutTorchrunReadsSlurm) {
  const LaunchEnv e = from({{"SLURM_PROCID", "5"},
                            {"SLURM_NTASKS", "8"},
                            {"SLURM_LOCALID", "1"},
                            {"SLURM_NODEID", "2"},
                            {"SLURM_TASKS_PER_NODE", "2(x4)"},
                            {"SLURM_JOB_NODELIST", "gpu-[007-010]"},
                            {"SLURM_JOB_ID", "1234567"}});
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "gpu-007");
  EXPECT_EQ(e.master_port, 20000 + 1234567 % 10000);
  // --ntasks-per-node, MASTER_ADDR and MASTER_PORT (set in the batch script) take precedence.
  const LaunchEnv f = from({{"SLURM_PROCID", "0"},
                            {"SLURM_NTASKS", "4"},
                            {"SLURM_LOCALID", "0"},
                            {"SLURM_NTASKS_PER_NODE", "4"},
                            {"SLURM_NODELIST", "a1,a2"},
                            {"MASTER_ADDR", "head"},
                            {"MASTER_PORT", "4000"}});
  EXPECT_EQ(f.local_world_size, 4);
  EXPECT_EQ(f.master_addr, "head");
  EXPECT_EQ(f.master_port, 4000);
}

TEST(LaunchEnv, SlurmHostListsGiveTheirFirstHost) {
  EXPECT_EQ(slurm_first_host("node01"), "node01");
  EXPECT_EQ(slurm_first_host("node[07-09,12],gpu3"), "node07");
  EXPECT_EQ(slurm_first_host("node[12,07-09]"), "node12");
  EXPECT_EQ(slurm_first_host("rack[1-2]-node[001-004]"), "rack1-node001");
  EXPECT_EQ(slurm_first_host("a,b[1-2]"), "a");
  EXPECT_THROW(slurm_first_host("node[1-2"), Error);
  EXPECT_THROW(slurm_first_host("node[x-2]"), Error);
  EXPECT_THROW(slurm_first_host(""), Error);
}

TEST(LaunchEnv, SlurmTasksPerNodeIsReadForTheRightNode) {
  EXPECT_EQ(slurm_tasks_on_node("4", 0), 4);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 0), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 2), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 3), 1);
  EXPECT_THROW(slurm_tasks_on_node("2(x3),1", 4), Error);
  EXPECT_THROW(slurm_tasks_on_node("2(x3", 0), Error);
  EXPECT_THROW(slurm_tasks_on_node("two", 0), Error);
}

TEST(LaunchEnv, MissingOrBadVariablesAreNamed) {
  EXPECT_NE(error_of({}).find("neither RANK (torchrun) nor SLURM_PROCID (srun)"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}}).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x'"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("rank 2 >= world size 2"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "2"},
                      {"SLURM_LOCALID", "0"},
                      {"SLURM_NTASKS_PER_NODE", "2"}})
                .find("SLURM_NODELIST is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "2"},
                      {"SLURM_LOCALID", "3"},
                      {"SLURM_NTASKS_PER_NODE", "2"},
                      {"SLURM_NODELIST", "a"}})
                .find("local rank 3 >= ranks on this node 2"),
            std::string::npos);
}

}  // namespace
}  // namespace gradcomp
