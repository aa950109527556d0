"""gradcomp inside the trainers people use, against the real packages (the `integrations` extra): 2 Gloo ranks each."""
import pathlib
import re

import pytest

from launcher import launch_env


def test_hookstate_made_before_the_process_group_matches_register():
    assert launch_env("workers_integrations", "hookstate_before_init", 2) == [True, True]


def test_a_hookstate_made_before_the_process_group_binds_once_under_concurrent_callers():
    assert launch_env("workers_integrations", "hookstate_binds_once_under_concurrent_callers", 2) == [1, 1]


def test_a_hookstate_never_handed_to_ddp_is_an_error_at_the_first_step():
    for message in launch_env("workers_integrations", "hookstate_never_handed_to_ddp", 2):
        assert "its hook had not run" in message and "register_comm_hook" in message, message


def _check_run(r):
    assert r["hook_steps"] == r["optimizer_steps"] > 0, r  # the hook ran on every optimizer step
    assert 6.5 < r["ratio"] < 8.5, r  # about 1/7 of an fp32 ring allreduce's bytes
    assert r["q4_accuracy"] >= r["dense_accuracy"] - 0.02, r
    assert r["resume_bit_exact"], r


def test_lightning_callback(tmp_path):
    pytest.importorskip("pytorch_lightning")
    for r in launch_env("workers_integrations", "lightning", 2, str(tmp_path), timeout=240):
        _check_run(r)
        assert 6.5 < r["logged_ratio"] < 8.5 and r["logged_bytes"] > 0, r  # through Lightning's logging
        assert r["resume_state_step"][0] == r["resume_state_step"][1], r


def test_lightning_documented_hook_route_on_cpu_is_an_error_not_a_silent_fp32_run(tmp_path):
    pytest.importorskip("pytorch_lightning")
    launch_env("workers_integrations", "lightning_documented_route_on_cpu", 2, str(tmp_path))


def test_accelerate_register(tmp_path):
    pytest.importorskip("accelerate")
    for r in launch_env("workers_hf", "accelerate", 2, str(tmp_path), timeout=240):
        _check_run(r)


def test_transformers_trainer_callback(tmp_path):
    pytest.importorskip("transformers")
    for r in launch_env("workers_hf", "transformers", 2, str(tmp_path), timeout=240):
        _check_run(r)
        assert r["logged"] and all(6.5 < h["gradcomp/ratio"] < 8.5 for h in r["logged"]), r["logged"]


@pytest.mark.parametrize("framework", ["pytorch_lightning", "accelerate", "transformers"])
def test_doc_recipes_run(framework, tmp_path):
    """docs/integrations.md's recipes are this code: each block runs on 2 Gloo ranks."""
    pytest.importorskip(framework)
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    adapter = {"pytorch_lightning": "gradcomp.integrations.lightning import",
               "accelerate": "gradcomp.integrations import accelerate",
               "transformers": "gradcomp.integrations.transformers import"}[framework]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if adapter in b]
    assert len(blocks) == 1, f"docs/integrations.md should have one {framework} recipe"
    assert launch_env("workers_integrations", "run_doc_block", 2, blocks[0], str(tmp_path)) == [True, True]
