"""Process groups from the launcher's environment: torchrun's variables, or Slurm's when srun
starts the ranks without torchrun (the Python helper, the example script and the C++ trainer)."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

import gradcomp.torch as gt

from cpp_trainer import digits_file, trainer_binary

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def _free_slurm_job_id() -> int:
    """A job id whose port (20000 + id % 10000) is free here."""
    for port in range(23000, 30000, 7):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 70000 + port - 20000
    raise RuntimeError("no free port")


def _srun_env(rank: int, world: int, job_id: int) -> dict:
    """What srun --ntasks=W (one node) gives each task, and no torchrun variable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHERS and not k.startswith("SLURM_")}
    env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
               SLURM_TASKS_PER_NODE=str(world), SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(job_id))
    return env


def _run_ranks(world: int, argv: list, timeout: float = 300) -> list:
    job = _free_slurm_job_id()
    procs = [subprocess.Popen(argv, env=_srun_env(r, world, job), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def test_launch_env_reads_torchrun_then_slurm(monkeypatch):
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    with pytest.raises(RuntimeError, match="neither RANK .torchrun. nor SLURM_PROCID .srun."):
        gt.launch_env()
    for k, v in _srun_env(3, 4, 1234).items():
        if k.startswith("SLURM_"):
            monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert gt.launch_env() == {"rank": 3, "world_size": 4, "local_rank": 1, "local_world_size": 2,
                               "master_addr": "gpu07", "master_port": 21234, "launcher": "slurm"}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert gt.launch_env()["launcher"] == "torchrun"


def test_the_example_trains_under_srun_without_torchrun():
    outs = _run_ranks(2, [sys.executable, "examples/ddp_train.py", "--codec", "q4", "--epochs", "3"])
    accuracy = float(outs[0].strip().splitlines()[-1].split()[-1])
    assert "codec=q4" in outs[0] and accuracy > 0.8, outs[0]


def test_the_cpp_trainer_runs_under_srun_without_torchrun(tmp_path):
    data = digits_file(tmp_path)
    outs = _run_ranks(2, [str(trainer_binary()), "--data", str(data), "--codec", "q4", "--epochs", "3"])
    ranks = [json.loads(line) for out in outs for line in out.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and ranks[0]["accuracy"] == ranks[1]["accuracy"] > 0.8, ranks
