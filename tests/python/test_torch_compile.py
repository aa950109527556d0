"""torch.compile and DDP: the hook runs under the default optimize_ddp (DDPOptimizer), and the
modes that replace DDP's C++ reducer are refused with a way out (real processes, real Gloo)."""
import pytest

from launcher import launch


@pytest.mark.parametrize("route", ["register", "standard"])
@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_compiled_ddp_runs_the_hook_on_every_bucket(route, codec):
    buckets = launch("workers_compile", "compiled_ddp_runs_the_hook", 2, route, codec, "aot_eager")
    assert buckets[0] == buckets[1] >= 2


def test_compiled_ddp_with_inductor_runs_the_hook():
    assert min(launch("workers_compile", "compiled_ddp_runs_the_hook", 2, "register", "q4", "inductor",
                      timeout=600)) >= 2


def test_python_reducer_is_refused_on_both_routes():
    assert launch("workers_compile", "python_reducer_is_refused", 2) == [4, 4]


@pytest.mark.parametrize("route", ["register", "standard"])
def test_compiled_autograd_is_refused_or_raises_before_the_hook_runs(route):
    assert all(launch("workers_compile", "compiled_autograd_is_refused", 2, route))


def test_grad_sync_refuses_compiled_autograd_by_name():
    assert all(launch("workers_compile", "grad_sync_under_compiled_autograd", 2))
