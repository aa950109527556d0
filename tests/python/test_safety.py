"""Loading state runs no code, metrics listen on loopback unless told otherwise, and the example's
checkpoints and metrics behave across restarts (issue 34, items 1, 2 and 11)."""
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

import torch

from launcher import launch
from workers_safety import RunsCode

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_state_refuses_a_pickle_that_runs_code(tmp_path):
    marker = str(tmp_path / "ran")
    refused, ran = launch("workers_safety", "fsdp_refuses_a_pickle_that_runs_code", 1, marker)[0]
    assert not ran, "loading the crafted FSDP state ran its code"
    assert "weights_only" in refused or "Unpickl" in refused, refused


def test_the_example_refuses_a_checkpoint_that_runs_code(tmp_path):
    marker = tmp_path / "ran"
    ckpt = tmp_path / "ckpt"
    torch.save({"model": RunsCode(str(marker))}, f"{ckpt}.rank0")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(pathlib.Path(__file__).parent))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                        str(ROOT / "examples" / "ddp_train.py"), "--epochs", "1", "--checkpoint", str(ckpt)],
                       env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "weights_only" in r.stderr, r.stderr[-3000:]
    assert not marker.exists(), "loading the crafted checkpoint ran its code"


def test_metrics_listen_on_loopback_unless_told_otherwise():
    port = _free_port()
    assert launch("workers_safety", "serve_binds", 1, port, None)[0] == ["0100007F"]  # 127.0.0.1
    port = _free_port()
    assert launch("workers_safety", "serve_binds", 1, port, "0.0.0.0")[0] == ["00000000"]


def test_the_example_serves_metrics_from_the_first_step_of_a_resumed_run(tmp_path):
    """A run restarted from a checkpoint past epoch 0 (the recipes' restart flow) serves its metrics
    while it trains, not only after an epoch 0 it never runs."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ckpt = str(tmp_path / "ckpt")

    def start(*extra, port=0):
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                 "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                                 str(ROOT / "examples" / "ddp_train.py"), "--checkpoint", ckpt,
                                 "--checkpoint-every", "20", *extra, *(["--metrics-port", str(port)] if port else [])],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    crashed = start("--epochs", "2", "--stop-after", "60")  # 44 steps an epoch: the checkpoint (step 60) is in epoch 1
    crashed.communicate(timeout=120)
    assert crashed.returncode != 0 and os.path.exists(ckpt + ".rank0")
    port = _free_port()
    resumed = start("--epochs", "40", port=port)
    scraped = ""
    try:
        while resumed.poll() is None and not scraped:
            try:
                scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.05)
        out, err = resumed.communicate(timeout=300)
    finally:
        resumed.kill()
    assert resumed.returncode == 0, err[-3000:]
    assert "gradcomp_steps_total" in scraped, "the resumed run never served its metrics while it trained"


def test_concurrent_scrapes_of_a_hook_state_make_one_native_hook():
    assert launch("workers_safety", "one_native_hook_under_concurrent_scrapes", 1)[0] == 1


def test_a_scrape_answers_while_fsdp_waits_for_a_stopped_peer():
    """Issue 34 item 6: the FSDP collective's lock was held across the network wait, and the scrape
    took it too: a stopped peer stalled every scrape until it came back."""
    stop = 8.0
    result = launch("workers_safety", "fsdp_scrape_while_a_peer_stops", 2, _free_port(), stop)[0]
    assert result["ok"] is True, result
    assert result["seconds"] < 2.0, f"the scrape waited {result['seconds']:.1f} s behind the collective"


def test_ddp_in_a_node_with_diloco_across_nodes_under_torchrun_variables_does_not_hang():
    """Issue 34 item 12: 4 "nodes" of 2 ranks, DiLoCo over each local rank's group across the nodes with
    local_world_size left to LOCAL_WORLD_SIZE: the group's 4 ranks were split into 2 "nodes" of ranks
    on different nodes, each rank enumerating different subgroups (a hang)."""
    results = launch("workers_safety", "ddp_in_node_diloco_across_nodes", 8, 2, timeout=120)
    assert results == [(1, True)] * 8, results
