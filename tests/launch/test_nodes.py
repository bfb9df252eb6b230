"""Which ranks run on which node, and the axes a job's nodes would split (torch-free)."""

import pytest

from automodel.config.layout import Layout
from automodel.config.nodes import blocks, ranks_by_node, split_axes_warning


@pytest.mark.fast
def test_ranks_by_node_lists_each_nodes_ranks_as_runs():
    assert ranks_by_node(blocks(8, 4)) == "ranks 0-3 on node 0, ranks 4-7 on node 1"
    assert ranks_by_node(["a", "b", "a", "b", "a", "a"]) == "ranks 0,2,4-5 on a, ranks 1,3 on b"


@pytest.mark.fast
def test_hsdp_replicates_across_nodes_and_shards_within():
    hsdp = Layout(dp_replicate=2, dp_shard=2)
    assert hsdp.axes_across_nodes(blocks(4, 2)) == []  # shard groups {0,1}, {2,3}: one node each
    assert hsdp.axes_across_nodes(["a", "b", "a", "b"]) == ["dp_shard"]  # ranks dealt round
    assert Layout(dp_shard=4).axes_across_nodes(blocks(4, 2)) == []  # plain FSDP may span


@pytest.mark.fast
def test_tp_and_cp_groups_that_span_nodes_are_named_with_the_fix():
    assert Layout(dp_shard=2, tp=2).axes_across_nodes(blocks(4, 2)) == []
    assert Layout(tp=4).axes_across_nodes(blocks(4, 2)) == ["tp"]
    assert Layout(cp=2, tp=2, dp_shard=2).axes_across_nodes(blocks(8, 2)) == ["cp_ring"]
    assert Layout(pp=2, tp=2).axes_across_nodes(blocks(4, 2)) == []  # pp crosses: fine
    message = split_axes_warning(Layout(tp=4), blocks(4, 2))
    assert "mesh axis tp spans nodes (ranks 0-1 on node 0, ranks 2-3 on node 1)" in message
    assert "mesh.tp_size" in message and "2 ranks of a node" in message
    assert split_axes_warning(Layout(tp=4), blocks(4, 4)) is None  # one node
