"""Which ranks run on which node, and the mesh axes that a job's nodes would split. No torch:
the submitter checks a layout against the nodes it asks for (ranks fill a node before the
next, as SLURM and torchrun place them), and a running job against the hostnames its ranks
report (``distributed.init``)."""

from __future__ import annotations

from automodel.config.layout import Layout


def blocks(world_size: int, per_node: int) -> list[int]:
    """The node of each rank (``node 0``, ...) when each node runs ``per_node`` consecutive
    ranks."""
    return [f"node {r // max(per_node, 1)}" for r in range(world_size)]


def ranks_by_node(node_of_rank: list) -> str:
    """``ranks 0-1 on node1, ranks 2-3 on node2``: each node's ranks, in rank order."""
    order: dict = {}
    for rank, node in enumerate(node_of_rank):
        order.setdefault(node, []).append(rank)
    return ", ".join(f"ranks {_spans(ranks)} on {node}" for node, ranks in order.items())


def _spans(ranks: list[int]) -> str:
    """``0-3,6``: runs of consecutive ranks."""
    runs = [[ranks[0], ranks[0]]]
    for r in ranks[1:]:
        if r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


_ADVICE = {"tp": "mesh.tp_size", "cp_ring": "mesh.cp_size", "cp_ulysses": "mesh.cp_size",
           "dp_shard": "mesh.dp_size / mesh.dp_replicate_size"}


def split_axes_warning(layout: Layout, node_of_rank: list) -> str | None:
    """A warning naming each axis that should stay within a node but spans nodes here
    (``Layout.axes_across_nodes``), with the fix; None when none does or on one node."""
    if len(set(node_of_rank)) < 2:
        return None
    split = layout.axes_across_nodes(node_of_rank)
    if not split:
        return None
    per_node = max(node_of_rank.count(n) for n in set(node_of_rank))
    names = ", ".join(dict.fromkeys("cp" if a.startswith("cp") else a for a in split))
    keys = ", ".join(dict.fromkeys(_ADVICE[a] for a in split))
    return (f"mesh axis {names} spans nodes ({ranks_by_node(node_of_rank)}): its collectives "
            f"run every layer and would cross the network; choose {keys} so that each group "
            f"fits in the {per_node} ranks of a node (the product of tp, cp and, under HSDP, "
            "dp_shard dividing the ranks per node)")
