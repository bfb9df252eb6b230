"""Probes: the per-layer costs of a model, simulated once per tensor-parallel degree and
activation-checkpointing mode, from which the search estimates any layout in microseconds.

A probe is the planner's own simulation (``simulate.py``) of a short copy of the model (its
configuration with 2, then 3 decoder layers) on 2 FSDP2 ranks x ``tp``, one micro-batch of one
sequence of the job's length, no pipeline. What changes between the two depths is one layer's
cost: its parameters, gradients and optimizer states; its activations at the peak; its FLOPs;
its collectives. What does not is the rest (embedding, head, loss, the temporaries of the
step). Layers of one model are alike, so a rank holding ``n`` of them costs ``rest + n x
layer`` (with the embedding and the head only where the rank holds them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_DEPTHS = (2, 3)
PROBE_DP = 2  # FSDP2 ranks of a probe (its collectives appear; sharded state is / 2)
STATE = ("parameters_sharded", "optimizer_states")  # kept between steps, sharded by FSDP


@dataclass
class LayerCosts:
    """One probe's result: per decoder layer (``layer_*``) and the rest (``rest_*``), for
    one sequence per micro-batch on ``tp`` ranks with FSDP over ``PROBE_DP``."""

    tp: int
    ac: str
    layer_state: float  # bytes of one layer's sharded parameters and optimizer states
    layer_activation: float  # one layer's share of the peak beyond its state
    layer_flops: float
    layer_comm: dict = field(default_factory=dict)  # axis -> kind -> bytes
    rest_state: float = 0.0  # embedding, head, norm: state
    rest_peak: float = 0.0  # what the peak holds besides the layers, per sequence (loss, ...)
    rest_fixed: float = 0.0  # ... and what does not grow with the micro-batch (gathered
    # parameters, temporaries)
    rest_flops: float = 0.0
    rest_comm: dict = field(default_factory=dict)


def ac_value(mode: str) -> str:
    """The override value of a checkpointing mode (none is ``false``)."""
    return "false" if mode == "none" else mode


def probe_overrides(base: list[str], tp: int, ac: str, depth: int, seq_len: int) -> list[str]:
    """train.py overrides of one probe: the job's own (model, data, precision, ...) without
    what the probe sets."""
    owned = ("mesh.", "pipeline", "plan.", "parallelism.activation_checkpointing",
             "parallelism.sequence_parallel", "trainer.global_batch_size",
             "trainer.local_batch_size", "model.config.num_hidden_layers", "parallelism=")
    from automodel.planning.cli import without_keys

    kept = without_keys(base, owned)
    return [*kept, "parallelism=fsdp2", "pipeline=none", f"mesh.dp_size={PROBE_DP}",
            f"mesh.tp_size={tp}", f"parallelism.activation_checkpointing={ac_value(ac)}",
            f"parallelism.sequence_parallel={str(tp > 1).lower()}",
            f"trainer.global_batch_size={PROBE_DP}", "trainer.local_batch_size=1",
            f"trainer.seq_len={seq_len}", f"++model.config.num_hidden_layers={depth}"]


def layer_costs(tp: int, ac: str, shallow: dict, deep: dict) -> LayerCosts:
    """From the simulations (``as_dict``) at the two depths."""
    def state(sim):
        return sum(sim["memory"][k] for k in STATE)

    d_state = state(deep) - state(shallow)
    d_peak = deep["peak_bytes"] - shallow["peak_bytes"]
    d_flops = deep["flops"] - shallow["flops"]
    n = PROBE_DEPTHS[0]
    fixed = shallow["memory"]["parameters_unsharded"] + shallow["memory"]["temporary"]
    rest = shallow["peak_bytes"] - state(shallow) - n * max(0.0, d_peak - d_state)
    return LayerCosts(
        tp, ac, layer_state=d_state, layer_activation=max(0.0, d_peak - d_state),
        layer_flops=d_flops, layer_comm=_comm_delta(shallow["comm"], deep["comm"]),
        rest_state=state(shallow) - n * d_state,
        rest_peak=max(0.0, rest - fixed), rest_fixed=min(rest, fixed),
        rest_flops=shallow["flops"] - n * d_flops,
        rest_comm=_comm_delta(_scaled(_comm_delta(shallow["comm"], deep["comm"]), n),
                              shallow["comm"]))


def _comm_delta(a: dict, b: dict) -> dict:
    """b - a, per axis and kind."""
    out: dict = {}
    for axis in {*a, *b}:
        kinds = {k: b.get(axis, {}).get(k, 0) - a.get(axis, {}).get(k, 0)
                 for k in {*a.get(axis, {}), *b.get(axis, {})}}
        out[axis] = {k: v for k, v in kinds.items() if v}
    return {axis: kinds for axis, kinds in out.items() if kinds}


def _scaled(comm: dict, factor: float) -> dict:
    return {axis: {k: v * factor for k, v in kinds.items()} for axis, kinds in comm.items()}


def run_probes(cfg, keys: list[tuple[int, str]], resolve_overrides, workers=None) -> dict:
    """``{(tp, ac): LayerCosts}``: each key simulated at both depths, in parallel.
    ``resolve_overrides(overrides) -> TrainConfig`` resolves a probe's config as plan.py
    does."""
    from automodel.planning.plan import simulate_configs

    configs = [resolve_overrides(probe_overrides(cfg.overrides, tp, ac, depth,
                                                 cfg.trainer.seq_len))
               for tp, ac in keys for depth in PROBE_DEPTHS]
    sims = simulate_configs(configs, [0] * len(configs), workers)
    return {key: layer_costs(*key, sims[2 * i], sims[2 * i + 1]) for i, key in enumerate(keys)}
