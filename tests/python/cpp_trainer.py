"""Builds (when needed) and launches the C++ digits trainer of examples/cpp under torchrun."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_binary() -> pathlib.Path:
    """$GRADCOMP_CPP_TRAINER (scripts/test_all.sh builds it against the installed package), or a
    build of examples/cpp against $GRADCOMP_TORCH_PREFIX, an install of gradcomp with its torch
    component."""
    if os.environ.get("GRADCOMP_CPP_TRAINER"):
        return pathlib.Path(os.environ["GRADCOMP_CPP_TRAINER"])
    prefix = os.environ.get("GRADCOMP_TORCH_PREFIX")
    if not prefix:
        raise RuntimeError("set GRADCOMP_CPP_TRAINER or GRADCOMP_TORCH_PREFIX (scripts/test_all.sh does)")
    build = ROOT / "build" / "example-cpp"
    subprocess.check_call(["cmake", "-S", str(ROOT / "examples" / "cpp"), "-B", str(build), "-G", "Ninja",
                           "-DCMAKE_BUILD_TYPE=Release",
                           f"-DCMAKE_PREFIX_PATH={prefix};{torch.utils.cmake_prefix_path}"],
                          stdout=subprocess.DEVNULL)
    subprocess.check_call(["cmake", "--build", str(build)], stdout=subprocess.DEVNULL)
    return build / "digits_trainer"


def digits_file(tmp: pathlib.Path) -> pathlib.Path:
    path = tmp / "digits.bin"
    if not path.exists():
        subprocess.check_call([sys.executable, str(ROOT / "examples" / "cpp" / "make_digits.py"), str(path)],
                              stderr=subprocess.DEVNULL)
    return path


class Run:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.returncode = proc.returncode
        self.stdout, self.stderr = proc.stdout, proc.stderr
        self.ranks = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')),
                            key=lambda r: r["rank"])
        self.lines = proc.stdout.splitlines()


def _torchrun(world: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}", "--no-python"]


def launch_quickstart(world: int, cwd: pathlib.Path) -> str:
    """Runs examples/cpp/quickstart.cpp (built beside the trainer) in `cwd`; returns its output."""
    binary = trainer_binary().parent / "quickstart"
    proc = subprocess.run(_torchrun(world) + [str(binary)], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def launch(world: int, args: list[str], timeout: float = 300, check: bool = True) -> Run:
    """torchrun --no-python the trainer on `world` Gloo ranks of this machine."""
    cmd = _torchrun(world) + [str(trainer_binary())] + [str(a) for a in args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    run = Run(proc)
    if check and (proc.returncode != 0 or len(run.ranks) != world):
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return run
