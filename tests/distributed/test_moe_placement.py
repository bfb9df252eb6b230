"""Where expert parallelism puts the experts: ``mesh.ep_size`` and ``parallelism.moe.*``.

Parity (``test_moe.py``) shows every ep layout computes one process's numbers; so would
experts left whole on every rank. Here, on four real gloo ranks, a tiny Qwen3-MoE (4 layers,
8 experts) is built and parallelized as the recipe does, and each rank reports which global
experts it holds (its local rows compared with the initial weights), the DTensor mesh and
placements of the expert weights, the FSDP2 unit holding them, whether that unit is gathered
between forward and backward, and its gradients:

- ``ep_size=2`` (``ep_shard`` 2): rank r holds experts of ep group ``r % 2`` (4 of 8), split
  again over the two ``ep_shard`` ranks (2 each); the experts are FSDP2 units of their own;
- ``moe.shard_experts=false``: each rank holds its ep group's 4 experts whole, replicated over
  ``ep_shard`` with the same all-reduced gradient;
- ``moe.reshard_after_forward``: the experts' units follow it, not their block's rule;
- ``ep_size=4``: 2 experts per rank, no ``ep_shard`` split;
- ``ep_size=1``: no expert unit; the experts are sharded with their block like any weight.
"""

import numpy as np
import torch

from tests.distributed.test_placement_effects import (
    OFFLOAD,
    fsdp_units,
    gathered_after_forward,
    layout,
    parallel_model,
)
from tests.helpers import run_on_ranks

EP2 = ["mesh.ep_size=2"]
RUNS = {
    "ep1": [],
    "ep2": EP2,
    "ep2_whole_kept": EP2 + ["parallelism.moe.shard_experts=false",
                             "parallelism.moe.reshard_after_forward=false"],
    "ep2_freed": EP2 + ["parallelism.reshard_after_forward=false",
                        "parallelism.moe.reshard_after_forward=true", OFFLOAD],
    "ep4": ["mesh.ep_size=4"],
}
EXPERTS = [f"model.layers.{i}.mlp.experts" for i in range(4)]
BLOCKS = [f"model.layers.{i}" for i in range(4)]


def _held(local: torch.Tensor, full: torch.Tensor) -> list:
    """The global expert indices of the rows of ``local`` (rows of ``full``)."""
    return [next((j for j in range(len(full)) if torch.equal(row, full[j])), None)
            for row in local]


def _moe_facts(rank, world):
    from automodel.models.builder import build_model

    facts = {}
    for name, extra in RUNS.items():
        cfg, setup, parallel = parallel_model(rank, world, ["model=qwen3_moe_tiny"] + extra)
        model = parallel.parts[0]
        initial = build_model(cfg.model, cfg.trainer.seed).state_dict()
        placed = layout(model)
        weights = {n: v for n, v in placed.items() if ".mlp.experts." in n}
        held = {n: _held(p.to_local(), initial[n]) for n, p in model.named_parameters()
                if n in weights}
        units = fsdp_units(model)
        gathered = gathered_after_forward(cfg, setup, parallel)
        facts[name] = dict(
            units=sorted(units), owners={n: v[0] for n, v in weights.items()},
            mesh={(v[1], v[2]) for v in weights.values()},
            local={v[3][0] for v in weights.values()},
            held={tuple(h) for h in held.values()},
            offload={u: {fp.offload_to_cpu for fp in g.fsdp_params} for u, g in units.items()},
            gathered=gathered,
            grad_sums=[float(p.grad.to_local().sum()) for n, p in model.named_parameters()
                       if n in weights])
    return facts


def test_experts_are_placed_over_ep_and_ep_shard(tmp_path):
    ranks = run_on_ranks(_moe_facts, 4, tmp_path=tmp_path)
    # the MoE mesh (pp, ep_shard, ep_unit, ep) over ranks [[0, 1], [2, 3]]: ep rank r % 2,
    # ep_shard rank r // 2
    for r, f in enumerate(ranks):
        ep, ep_shard = r % 2, r // 2
        # ep 1: the experts are in their block's unit, sharded over dp like any weight
        one = f["ep1"]
        assert one["units"] == sorted(["", *BLOCKS])
        assert set(one["owners"].values()) == set(BLOCKS)
        assert one["mesh"] == {((("dp_shard_cp", 4),), ("S0",))}
        assert one["held"] == {(2 * r, 2 * r + 1)}
        # ep 2: the ep group's 4 experts, split in 2 over ep_shard; units of their own
        two = f["ep2"]
        assert two["units"] == sorted(["", *BLOCKS, *EXPERTS])
        assert {o for o in two["owners"].values()} == set(EXPERTS)
        assert two["mesh"] == {((("ep_shard", 2), ("ep", 2)), ("S0", "S0"))}
        assert two["held"] == {(4 * ep + 2 * ep_shard, 4 * ep + 2 * ep_shard + 1)}
        # moe.reshard_after_forward=null: the experts' units follow their blocks (all but
        # the last reshard)
        assert two["gathered"] == {"": True, **{b: b == BLOCKS[-1] for b in BLOCKS},
                                   **{e: e == EXPERTS[-1] for e in EXPERTS}}
        # shard_experts=false: the ep group's 4 experts whole, replicated over ep_shard, with
        # the same all-reduced gradient there: the sum of the two sharded ranks' gradients
        whole = f["ep2_whole_kept"]
        assert whole["mesh"] == {((("ep_shard", 2), ("ep_unit", 1), ("ep", 2)),
                                  ("R", "S0", "S0"))}
        assert whole["held"] == {tuple(range(4 * ep, 4 * ep + 4))} and whole["local"] == {4}
        assert whole["grad_sums"] == ranks[r ^ 2]["ep2_whole_kept"]["grad_sums"]
        pair = [a + b for a, b in zip(two["grad_sums"], ranks[r ^ 2]["ep2"]["grad_sums"])]
        np.testing.assert_allclose(whole["grad_sums"], pair, rtol=1e-5, atol=1e-6)
        # moe.reshard_after_forward=false: every expert unit stays gathered after forward
        assert whole["gathered"] == {**two["gathered"], **dict.fromkeys(EXPERTS, True)}
        # moe.reshard_after_forward=true: the experts freed while their blocks stay gathered
        # (parallelism.reshard_after_forward=false); the offload policy reaches the experts'
        # units too
        freed = f["ep2_freed"]
        assert freed["gathered"] == {"": True, **dict.fromkeys(BLOCKS, True),
                                     **dict.fromkeys(EXPERTS, False)}
        assert freed["offload"] == dict.fromkeys(freed["units"], {True})
        assert f["ep2"]["offload"] == dict.fromkeys(two["units"], {False})
        # ep 4: 2 experts per rank, nothing left to split over ep_shard
        four = f["ep4"]
        assert four["mesh"] == {((("ep_shard", 1), ("ep", 4)), ("S0", "S0"))}
        assert four["held"] == {(2 * r, 2 * r + 1)} and four["local"] == {2}
