"""Every front end's bytes_sent is what its process put on the wire: each rank's count over a few
steps against the TCP bytes its Gloo sockets sent over the same steps (real Gloo ranks, W = 2, 3)."""
import shutil

import pytest

from launcher import launch

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to read tcp_info")

# Gloo frames each message (a header of tens of bytes), so the wire carries a little more than the
# payloads: at most this fraction plus a constant per step. A count that misses a collective, or
# counts one that did not happen, is off by far more (a bucket's payload is kilobytes).
_FRAMING = 0.04
_SLACK = 1024


def _check(results, steps):
    for rank, (wire, counted) in enumerate(results):
        assert counted > 0, f"rank {rank} counted nothing"
        assert counted <= wire <= counted * (1 + _FRAMING) + steps * _SLACK, (
            f"rank {rank}: bytes_sent says {counted}, its sockets sent {wire}")


@pytest.mark.parametrize("world,codec", [(3, "q4"), (2, "topk")])
def test_ddp_hook_counts_the_bytes_its_sockets_sent(world, codec):
    _check(launch("workers_wire", "ddp_hook", world, codec), steps=3)


def test_fsdp_counts_the_bytes_its_sockets_sent():
    _check(launch("workers_wire", "fsdp", 3), steps=3)


def test_diloco_counts_the_bytes_its_sockets_sent():
    _check(launch("workers_wire", "diloco", 2), steps=3)
