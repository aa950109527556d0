"""Convergence on scikit-learn's digits, 2 Gloo ranks, 30 epochs, mean over 3 seeds."""
import statistics

import pytest

from launcher import launch

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def accuracy():
    results = {}

    def run(codec, error_feedback=True):
        key = (codec, error_feedback)
        if key not in results:
            per_rank = launch("workers_ddp", "digits_accuracy", 2, codec, error_feedback, SEEDS, timeout=600)
            assert per_rank[0] == per_rank[1], "ranks disagree on the trained model"
            results[key] = statistics.mean(per_rank[0])
        return results[key]

    return run


def test_q4_matches_uncompressed(accuracy):
    assert accuracy("q4") >= accuracy("ddp") - 0.01, (accuracy("q4"), accuracy("ddp"))


def test_topk_with_error_feedback_matches_uncompressed(accuracy):
    assert accuracy("topk") >= accuracy("ddp") - 0.01, (accuracy("topk"), accuracy("ddp"))


def test_topk_without_error_feedback_is_clearly_worse(accuracy):
    # The control that shows the error-feedback tests can fail.
    assert accuracy("topk", False) <= accuracy("ddp") - 0.02, (accuracy("topk", False), accuracy("ddp"))
