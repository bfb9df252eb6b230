"""The device mesh on 4 real ranks: axes, flattened views, sub-group timeouts."""

import datetime

import torch

from automodel.config.layout import Layout
from automodel.distributed.mesh import MeshAxis, build_mesh, build_mesh_for
from tests.helpers import run_on_ranks


def _facts(rank, world):
    ctx = build_mesh("cpu", "gloo", 3, pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=1)
    group = ctx[MeshAxis.DP_SHARD].get_group()
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t, group=ctx[MeshAxis.DP_SHARD_CP].get_group())
    # every axis of the live mesh has the Layout's size; the MoE mesh its regrouping
    moe_layout = Layout(dp_shard=2, cp=2, ep=2)
    moe = build_mesh_for(moe_layout, "cpu", "gloo", 3)
    live = {(layout, axis.value): m.size(axis) for layout, m in ((ctx.layout, ctx),
                                                                 (moe_layout, moe))
            for axis in MeshAxis}
    return {"sizes_match": all(layout.size(axis) == n for (layout, axis), n in live.items()),
            "moe": (tuple(moe.moe.mesh.shape), moe.moe.mesh_dim_names,
                    moe.moe["ep"].get_local_rank()),
            "dp_size": ctx.dp_size, "dp_rank": ctx.dp_rank,
            "replicate": ctx.dp_replicate_size, "fsdp_mesh": ctx.fsdp_mesh().mesh_dim_names,
            "shard_size": ctx.size(MeshAxis.DP_SHARD_CP), "timeout": timeout,
            "shard_sum": float(t)}


def test_hsdp_mesh_views_and_timeouts(tmp_path):
    facts = run_on_ranks(_facts, 4, tmp_path=tmp_path)
    assert [f["dp_rank"] for f in facts] == [0, 1, 2, 3]
    assert all(f["sizes_match"] for f in facts)
    # (pp, ep_shard, ep_unit, ep): the 4 ranks of the stage as 2 x 2, ep ranks contiguous
    assert [f["moe"] for f in facts] == [((1, 2, 1, 2), ("pp", "ep_shard", "ep_unit", "ep"), r % 2)
                                         for r in range(4)]
    assert all(f["dp_size"] == 4 and f["replicate"] == 2 and f["shard_size"] == 2 for f in facts)
    # (the shard dim is dp_shard x cp: context-parallel ranks shard parameters too)
    assert all(f["fsdp_mesh"] == ("dp_replicate", "dp_shard_cp") for f in facts)
    # shard groups are {0,1} and {2,3}
    assert [f["shard_sum"] for f in facts] == [1.0, 1.0, 5.0, 5.0]
    # distributed.timeout_minutes reaches every sub-group (torch's own default is 30 min)
    assert all(f["timeout"] == datetime.timedelta(minutes=3) for f in facts)
