"""Probes: the per-layer costs of a model, simulated once per tensor-parallel degree and
activation-checkpointing mode, from which the search estimates any layout in microseconds.

A probe is the planner's own simulation (``simulate.py``) of a short copy of the model (its
configuration with 4, then 5 decoder layers: past the edge effects, ``depth.py``) on 2 FSDP2
ranks (more where expert parallelism needs them) x ``cp`` x ``tp``, with ``ep`` expert ranks,
one micro-batch of one sequence of the job's length, no pipeline. What changes
between the two depths is one layer's cost: its parameters, gradients and optimizer states; its
activations at the peak; its FLOPs; its collectives. What does not is the rest (embedding,
head, loss, the temporaries of the step). Layers of one model are alike, so a rank holding
``n`` of them costs ``rest + n x layer`` (with the embedding and the head only where the rank
holds them).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from automodel.planning.depth import SHALLOW as PROBE_DEPTHS  # (why these depths: there)

# the layout keys of a job that the search chooses (and each probe sets for itself)
LAYOUT_KEYS = ("mesh.", "pipeline", "parallelism.activation_checkpointing",
               "parallelism.sequence_parallel", "trainer.local_batch_size")
# the axes whose traffic is the activations' (it grows with a rank's tokens, per layer and
# micro-batch): tensor, context (ring and Ulysses) and expert parallelism
ACTIVATION_AXES = ("tp", "cp", "cp_ring", "cp_ulysses", "ep")
PROBE_DP = 2  # FSDP2 ranks of a probe (its collectives appear; sharded state is / 2)
STATE = ("parameters_sharded", "optimizer_states")  # kept between steps, sharded by FSDP


@dataclass(frozen=True, order=True)
class ProbeKey:
    """What a probe simulates: the degrees that change a layer's shapes and traffic (``tp``,
    ``cp``, ``ep``, sequence parallelism), the checkpointing mode, and HSDP (``replicated``:
    2 replicas of the FSDP ranks)."""

    tp: int
    ac: str
    replicated: bool = False
    cp: int = 1
    ep: int = 1
    sp: bool = True  # sequence parallelism where tp > 1 (off for mixture-of-experts models)

    @property
    def dp(self) -> int:
        """The probe's FSDP ranks: ``PROBE_DP``, or the fewest above it that make the stage's
        dp x cp x tp ranks two or more multiples of ``ep`` (so that the experts, too, are
        sharded by FSDP, over ``ep_shard``)."""
        unit = self.ep // math.gcd(self.ep, self.cp * self.tp)
        least = max(PROBE_DP, -(-2 * self.ep // (self.cp * self.tp)))
        return unit * -(-least // unit)

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}", *(f"{k}{v}" for k, v in (("cp", self.cp), ("ep", self.ep))
                                   if v > 1), self.ac]
        return "_".join(parts) + ("_hsdp" if self.replicated else "")


@dataclass
class LayerCosts:
    """One probe's result: per decoder layer (``layer_*``) and the rest (``rest_*``), for
    one sequence per micro-batch on ``tp`` x ``cp`` ranks with FSDP over ``dp`` (x 2
    replicas where ``replicated``)."""

    tp: int
    ac: str
    layer_state: float  # bytes of one layer's sharded parameters and optimizer states
    layer_activation: float  # one layer's activations at the peak, per sequence
    layer_flops: float
    layer_comm: dict = field(default_factory=dict)  # axis -> kind -> bytes
    rest_state: float = 0.0  # embedding, head, norm: state
    rest_peak: float = 0.0  # what the peak holds besides the layers, per sequence (the
    # loss, the embedding's output, a recomputed layer's activations ...)
    rest_fixed: float = 0.0  # ... and what does not grow with the micro-batch (gathered
    # parameters, gradients, temporaries)
    rest_flops: float = 0.0
    rest_comm: dict = field(default_factory=dict)
    # the peak while the optimizer steps (states, gradients, the step's temporaries): a
    # peak of its own where the state outweighs the activations
    layer_optimizer_peak: float = 0.0
    rest_optimizer_peak: float = 0.0
    replicated: bool = False  # HSDP: 2 replicas of the sharded ranks
    layer_fixed: float = 0.0  # the rest of one layer's share of the peak (not per sequence)
    dp: int = PROBE_DP  # the probe's FSDP ranks (per replica)
    cp: int = 1
    ep: int = 1
    # of layer_state, the experts' (their parameter shards and optimizer states, measured):
    # FSDP pads their expert dimension to its shard count, so it scales by rows, not ranks
    layer_expert_state: float = 0.0
    # rest_peak measured (the run with two sequences); False: the rest's peak is all in
    # rest_fixed, right for micro-batches of one sequence only (``estimate`` refuses others)
    rest_split: bool = True


def ac_value(mode: str) -> str:
    """The override value of a checkpointing mode (none is ``false``)."""
    return "false" if mode == "none" else mode


def probe_overrides(base: list[str], key: ProbeKey, depth: int, seq_len: int,
                    sequences: int = 1) -> list[str]:
    """train.py overrides of one probe: the job's own (model, data, precision, ...) without
    what the probe sets."""
    owned = (*LAYOUT_KEYS, "plan.", "trainer.global_batch_size",
             "model.config.num_hidden_layers", "parallelism=")
    from automodel.planning.job_env import without_keys

    kept = without_keys(base, owned)
    dp = key.dp * (2 if key.replicated else 1)
    extra = ["mesh.dp_replicate_size=2"] if key.replicated else []
    extra += [f"mesh.{k}_size={v}" for k, v in (("cp", key.cp), ("ep", key.ep)) if v > 1]
    return [*kept, "parallelism=fsdp2", "pipeline=none", f"mesh.dp_size={dp}", *extra,
            f"mesh.tp_size={key.tp}", f"parallelism.activation_checkpointing={ac_value(key.ac)}",
            f"parallelism.sequence_parallel={str(key.tp > 1 and key.sp).lower()}",
            f"trainer.global_batch_size={dp * sequences}",
            f"trainer.local_batch_size={sequences}",
            f"trainer.seq_len={seq_len}", f"++model.config.num_hidden_layers={depth}"]


def layer_costs(key: ProbeKey, shallow: dict, deep: dict, wider: dict | None) -> LayerCosts:
    """From the simulations (``as_dict``) at the two depths, and of the shallow one with two
    sequences per micro-batch (``wider``: what the rest holds per sequence; None: not run,
    ``LayerCosts.rest_split``)."""
    def state(sim):
        return sum(sim["memory"][k] for k in STATE)

    d_state = state(deep) - state(shallow)
    d_peak = deep["peak_bytes"] - shallow["peak_bytes"]
    d_flops = deep["flops"] - shallow["flops"]
    d_opt = deep["optimizer_peak_bytes"] - shallow["optimizer_peak_bytes"]
    n = PROBE_DEPTHS[0]
    growth = max(0.0, d_peak - d_state)  # one layer's share of the peak beyond its state:
    # what it keeps per sequence (the tracker's activations) and what it does not (its
    # gradient, buffers of its reduction)
    d_act = min(growth, max(0.0, deep["memory"]["activations"]
                            - shallow["memory"]["activations"]))
    rest = shallow["peak_bytes"] - state(shallow) - n * growth
    per_sequence = 0.0 if wider is None else \
        min(rest, max(0.0, wider["peak_bytes"] - shallow["peak_bytes"] - n * d_act))
    return LayerCosts(
        key.tp, key.ac, replicated=key.replicated, dp=key.dp, cp=key.cp, ep=key.ep,
        layer_state=d_state, layer_activation=d_act,
        layer_fixed=growth - d_act, layer_flops=d_flops,
        layer_comm=_comm_delta(shallow["comm"], deep["comm"]),
        rest_state=state(shallow) - n * d_state,
        rest_peak=per_sequence, rest_fixed=rest - per_sequence,
        rest_flops=shallow["flops"] - n * d_flops,
        rest_comm=_comm_delta(_scaled(_comm_delta(shallow["comm"], deep["comm"]), n),
                              shallow["comm"]),
        layer_optimizer_peak=d_opt,
        layer_expert_state=deep["expert_state_bytes"] - shallow["expert_state_bytes"],
        rest_optimizer_peak=shallow["optimizer_peak_bytes"] - n * d_opt,
        rest_split=wider is not None)


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


def run_probes(cfg, keys: list[ProbeKey], resolve_overrides, workers=None,
               wide=None) -> dict:
    """``{key: LayerCosts}``: each key simulated at both depths, in parallel, and the keys in
    ``wide`` (None: all) at the shallow one with two sequences too (the layouts of a key
    without it take micro-batches of one sequence). ``resolve_overrides(overrides) ->
    TrainConfig`` resolves a probe's config as plan.py does."""
    from automodel.planning.plan import simulate_configs

    keys = sorted(set(keys))
    workers = workers or os.cpu_count() or 1
    # one process per worker, running its share in turn (round robin over the keys: alike
    # costs per share)
    keys = [k for w in range(workers) for k in keys[w::workers]]
    runs = {k: [(PROBE_DEPTHS[0], 1), (PROBE_DEPTHS[1], 1)]
            + ([(PROBE_DEPTHS[0], 2)] if wide is None or k in wide else []) for k in keys}
    tasks = [(key, depth, sequences) for key in keys for depth, sequences in runs[key]]
    configs = [resolve_overrides(probe_overrides(cfg.overrides, key, depth,
                                                 cfg.trainer.seq_len, sequences))
               for key, depth, sequences in tasks]
    names = [f"probe {key.name} ({depth} layers, {sequences} per micro-batch)"
             for key, depth, sequences in tasks]
    sims = simulate_configs(configs, [0] * len(configs), names, workers=workers,
                            together=-(-len(configs) // workers))
    out, i = {}, 0
    for key in keys:
        k = len(runs[key])
        out[key] = layer_costs(key, *sims[i:i + 2], sims[i + 2] if k == 3 else None)
        i += k
    return out
