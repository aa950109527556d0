"""Hierarchical compression with real processes: simulated nodes of L ranks over Gloo groups."""
import pytest

from launcher import launch


@pytest.mark.parametrize("transport", ["shm", "group"])
# 3001 elements: shards padded with zeros; 3000 over 4 ranks: whole shards, exchanged in place.
@pytest.mark.parametrize("world,local,n", [(4, 2, 3001), (8, 4, 3000)])
def test_hook_equals_the_three_step_reference_and_the_byte_formula(world, local, n, transport):
    stats = launch("workers_hierarchical", "equality", world, local, n, transport, timeout=300)
    # q4: what leaves the node is about an L-th of the flat scheme's (1/8 of fp32 per rank, / L).
    q4 = stats[0]["q4"]
    assert q4["inter_node_bytes"] < q4["uncompressed_bytes"] / (6 * local)


def test_checkpoint_resume_routes_and_topology_errors():
    stats = launch("workers_hierarchical", "checkpoint", 4, 2)
    assert stats[0]["buckets"] > 0


def test_layout_mismatch_raises_on_every_rank_naming_the_rank():
    errors = launch("workers_hierarchical", "layout_mismatch", 4, 2, timeout=60)
    assert len(errors) == 4


def test_bad_local_world_size_is_refused():
    assert all(launch("workers_hierarchical", "bad_local_world_size", 2))
