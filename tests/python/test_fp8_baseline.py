"""The end-to-end benchmark's baselines: the FP8 hook (bench/fp8_hook.py) does what the frameworks'
hooks do: the mean over the ranks within e4m3's error, and DDP trains with it."""
from launcher import launch


def test_fp8_mean_is_within_e4m3s_error_and_ddp_trains_with_it():
    assert all(launch("workers_fp8", "fp8_mean_and_training", 3))


def test_powersgd_runs_with_ddps_buckets_through_a_group_per_bucket():
    assert all(n >= 3 for n in launch("workers_fp8", "powersgd_with_ddps_buckets", 2))
