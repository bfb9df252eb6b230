"""``plan.search=true``: the layouts of ``plan.gpus`` GPUs that fit, fastest first.

1. Enumerate (``candidates.py``): dp_replicate x dp_shard x tp x cp x pp x ep, the schedule,
   activation checkpointing and the micro-batch size at the job's global batch.
2. Estimate each from probes (``probes.py``: one layer's simulated costs per tp, cp, ep and
   checkpointing mode) and the schedule's own timeline (its bubble, the micro-batches each
   stage holds): memory per pipeline rank, bytes per axis, FLOPs, then the cost model. Keys
   whose layouts cannot rank among the fastest are never probed (``prune.py``).
3. Drop what does not fit, rank by step time, and plan the fastest in full (``make_plan``: the
   real simulation) to confirm it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

from automodel.config.pipeline_layout import stage_layer_ranges
from automodel.costing import cost
from automodel.costing.gpus import GpuProfile
from automodel.planning.candidates import Candidate, admitted, candidates
from automodel.planning.probes import ACTIVATION_AXES, LAYOUT_KEYS
from automodel.planning.search_text import CONFIRM_TRIES, search_summary


@functools.lru_cache(maxsize=None)
def _schedule(pipeline_name: str, pp: int, microbatches: int):
    """(bubble, micro-batches held per stage, stages of each rank, stage count) of the
    schedule."""
    from automodel.config.schema import PipelineConfig
    from automodel.distributed.pipelining.bubble import (
        bubble_fraction,
        in_flight,
        schedule_timeline,
    )

    p = PipelineConfig(pp_schedule=pipeline_name)
    timeline = schedule_timeline(p, pp, microbatches)
    return (bubble_fraction(timeline), tuple(in_flight(timeline)),
            tuple(tuple(s) for s in timeline.stages_by_rank), timeline.num_stages)

_SCHEDULE_NAMES = {"1f1b": "1f1b", "interleaved": "interleaved_1f1b"}


def estimate(c: Candidate, costs, model: dict, job: dict, profile: GpuProfile,
             calibration: dict | None = None) -> dict:
    """The candidate's predicted peak per pipeline rank, step time and fit, from its probe
    ``costs`` (``LayerCosts`` at its tp and checkpointing mode). ``model``: layers, hidden,
    embed_share / head_share (of the probe's rest state); ``job``: global_batch, seq_len,
    activation_bytes (of an element passed between stages)."""
    if c.mbs > 1 and not costs.rest_split:
        raise ValueError(f"{costs.tp=} {costs.cp=}: a probe without the run of two sequences "
                         f"cannot estimate micro-batches of {c.mbs}")
    dp = c.dp_replicate * c.dp_shard
    micro = job["global_batch"] // dp // c.mbs
    if c.pp > 1:
        bubble, held, by_rank, n_stages = _schedule(_SCHEDULE_NAMES[c.schedule], c.pp, micro)
    else:
        bubble, held, by_rank, n_stages = 0.0, (1,), ((0,),), 1
    layers = [len(r) for r in stage_layer_ranges(model["layers"], n_stages)]
    sizes = cost.mesh_sizes(c.layout)
    ranks = [_rank(c, costs, model, job, stages, layers, held, n_stages, micro)
             for stages in by_rank]
    for r in ranks:
        r["time"] = cost.step_time(r["flops"], r["comm"], sizes, profile, bubble,
                                   calibration).as_dict()
        r["fits"] = profile.headroom(r["peak_bytes"]) >= 0
    slowest = max(r["time"]["step_time_s"] for r in ranks)
    return {"candidate": dataclasses.asdict(c), "overrides": c.overrides(), "bubble": bubble,
            "peak_bytes": max(r["peak_bytes"] for r in ranks), "step_time_s": slowest,
            "tokens_per_s": job["global_batch"] * job["seq_len"] / slowest,
            "fits": all(r["fits"] for r in ranks), "ranks": ranks}


def _rank(c: Candidate, costs, model: dict, job: dict, stages, layers, held, n_stages,
          micro) -> dict:
    """One pipeline rank: its layers, what it holds at the peak, its work and its traffic."""
    n = sum(layers[s] for s in stages)
    head = n_stages - 1 in stages  # (with the loss, whose logits grow with the micro-batch)
    ends = (0 in stages) * model["embed_share"] + (n_stages - 1 in stages) * model["head_share"]
    ends = ends if c.pp > 1 else 1
    rows, padded = _expert_scale(c, costs, model)
    state = _sharded(c, costs, rows, n, ends, costs.layer_state, costs.rest_state)
    activations = costs.layer_activation * c.mbs * sum(layers[s] * held[s] for s in stages) \
        + costs.layer_fixed * n
    flops = (costs.layer_flops * n + costs.rest_flops * head) * c.mbs * micro
    comm = _rank_comm(c, costs, n, micro, head, ends, padded)
    if c.pp > 1:
        p2p = c.mbs * job["seq_len"] // c.cp * model["hidden"] * job["activation_bytes"] * micro
        comm["pp"] = {"send": p2p * len(stages), "recv": p2p * len(stages)}
    # the rest of the peak (the loss, the head's gradient...) is the probe's, on the rank with
    # the head: its part per sequence (measured with two) grows with the micro-batch
    rest = costs.rest_peak * c.mbs * (c.pp == 1 or head)
    peak = state + activations + costs.rest_fixed + rest
    if c.pp > 1:  # the stage keeps its layers gathered all step (one gather each, _gathers)
        peak += n * _fsdp_bytes(costs.layer_comm, "all_gather", padded) / 2
    if micro > 1:  # FSDP2 keeps unsharded gradients between micro-batches (it reduces once)
        peak += n * _fsdp_bytes(costs.layer_comm, "reduce_scatter", padded) \
            + ends * _fsdp_bytes(costs.rest_comm, "reduce_scatter", padded)
    # the optimizer's step: the sharded states, gradients and the step's temporaries
    stepping = _sharded(c, costs, rows, n, ends, costs.layer_optimizer_peak,
                        costs.rest_optimizer_peak)
    return {"stages": list(stages), "layers": n, "peak_bytes": int(max(peak, stepping)),
            "flops": flops, "comm": comm}


def _fsdp_bytes(comm: dict, kind: str, padded: float) -> float:
    """A probe's bytes of one kind on its FSDP axes (a gather's: the unsharded parameters; a
    reduce-scatter's: the unsharded gradients), the experts' at the candidate's padding."""
    return sum(kinds.get(kind, 0) * (padded if axis == "ep_shard" else 1)
               for axis, kinds in comm.items() if axis in FSDP_AXES)


def _sharded(c: Candidate, costs, rows: float, n: int, ends: float, layer: float,
             rest: float) -> float:
    """A probe's sharded bytes (``layer`` per layer, of which the experts' state is
    ``costs.layer_expert_state``, and ``rest`` where the rank holds the embedding and head)
    on the candidate's ranks: FSDP shards the rest over dp_shard x cp (the probe's tp and, for
    its own costs, cp), the experts by ``rows`` (``_expert_scale``)."""
    dense = costs.dp * costs.cp / (c.dp_shard * c.cp)
    experts = costs.layer_expert_state
    return ((layer - experts) * n + rest * ends) * dense \
        + experts * n * rows


def _expert_scale(c: Candidate, costs, model: dict) -> tuple[float, float]:
    """(state, traffic) of the candidate's experts per the probe's. FSDP shards each rank's
    ``experts / ep`` experts by rows over its shards (ep_shard under expert parallelism, else
    dp_shard x cp), padding the rows to a multiple of them: a rank keeps ``ceil(local /
    shards)`` rows, and a gather moves ``shards`` times that."""
    data = costs.dp * (2 if costs.replicated else 1)
    if not model.get("experts"):  # (a dense model, or no count given: by ranks)
        return data * costs.cp / (c.dp_replicate * c.dp_shard * c.cp), 1.0

    def rows(ep: int, shards: int) -> tuple[int, int]:
        return -(-(model["experts"] // ep) // shards), shards

    probe = rows(costs.ep, data * costs.cp * costs.tp // costs.ep if costs.ep > 1
                 else costs.dp * costs.cp)
    mine = rows(c.ep, c.layout.ep_shard if c.ep > 1 else c.dp_shard * c.cp)
    return mine[0] / probe[0], mine[0] * mine[1] / (probe[0] * probe[1])


# a probe's FSDP axes -> the candidate's: parameters are sharded over dp_shard x cp (named by
# the axes of size > 1, Layout.canonical_axis), the experts of expert parallelism over ep_shard
FSDP_AXES = {"dp_shard": "dp_shard_cp", "dp_shard_cp": "dp_shard_cp", "ep_shard": "ep_shard"}


def _rank_comm(c: Candidate, costs, n: int, micro: int, head: bool, ends: float,
               padded: float = 1.0) -> dict:
    """The activations' traffic per layer and micro-batch (the rest's on the rank with the
    head); FSDP gathers per micro-batch and reduce-scatters the gradients once per step (the
    layers', and the rest's where the rank holds the embedding or the head: ``ends``); HSDP
    all-reduces the shards across replicas once per step. ``padded``: the experts' gathered
    rows per the probe's (their traffic, on ep_shard)."""
    comm: dict = {}
    layout = c.layout

    def add(axis: str, kind: str, b: float) -> None:
        kinds = comm.setdefault(axis, {})
        kinds[kind] = kinds.get(kind, 0) + b

    for axis in {*costs.layer_comm, *costs.rest_comm}:
        layer, rest = costs.layer_comm.get(axis, {}), costs.rest_comm.get(axis, {})
        for kind in {*layer, *rest}:
            b, r = layer.get(kind, 0), rest.get(kind, 0)
            if axis == "ep_shard":
                b, r = b * padded, r * padded
            if axis in ACTIVATION_AXES:
                add(axis, kind, (b * n + r * head) * c.mbs * micro)
            elif axis in FSDP_AXES and layout.size(FSDP_AXES[axis]) > 1:
                target = layout.canonical_axis(FSDP_AXES[axis])
                if kind == "reduce_scatter":
                    add(target, kind, b * n + r * ends)
                elif kind == "all_gather":
                    add(target, kind, _gathers(b, r, n, ends, micro, c.pp > 1))
            elif axis == "dp_replicate" and kind == "all_reduce" and c.dp_replicate > 1:
                add(axis, kind, (b * n + r * ends) * costs.dp / c.dp_shard)  # (once)
    return {axis: {k: v for k, v in kinds.items() if v > 0} for axis, kinds in comm.items()}


def _gathers(layer: float, rest: float, n: int, ends: float, micro: int,
             pipelined: bool) -> float:
    """FSDP's all-gather bytes of a step. In the probe (no pipeline) every layer but the last
    is gathered twice a micro-batch (forward, and again for the backward: it reshards after
    the forward), the last once, the embedding and head once: ``layer`` is two gathers, and
    ``rest`` the ends' gather less one layer's. Under a pipeline nothing reshards after the
    forward, and the parameters stay gathered from one micro-batch to the next: each is
    gathered once a step."""
    if pipelined:
        return layer / 2 * n + (rest + layer / 2) * ends
    return (layer * n + rest * ends) * micro


def model_facts(cfg) -> dict:
    """What the search needs of the model: its layers and width, its heads, its experts and
    whether its attention can be split over context-parallel ranks (the checks train.py runs
    before launch), and how its non-layer state splits between the first stage (embedding)
    and the last (head)."""
    from automodel.distributed import context_parallel
    from automodel.models import multimodal as mm
    from automodel.models.builder import build_meta_model
    from automodel.models.experts import expert_modules

    meta = build_meta_model(cfg.model)
    text = mm.text_config(meta.config)
    tied = bool(getattr(text, "tie_word_embeddings", False))
    modules = expert_modules(meta)
    experts = [m.num_experts for m in modules.values()
               if isinstance(getattr(m, "num_experts", None), int)]
    try:
        context_parallel.check_model(meta, 2, 1, 1)
        cp_ok = True
    except ValueError:
        cp_ok = False
    return {"layers": text.num_hidden_layers, "hidden": text.hidden_size,
            "heads": text.num_attention_heads,
            "kv_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            "moe": bool(modules), "experts": math.gcd(*experts) if experts else 0,
            "context_parallel": cp_ok,
            # untied: the embedding and the head are equal; tied: each end holds a copy
            "embed_share": 1.0 if tied else 0.5, "head_share": 1.0 if tied else 0.5}


def resolve_for_search(overrides: list[str]):
    """The job's own settings (model, data, precision, batch, ...) resolved as one rank: its
    layout is what the search chooses, so none may be given."""
    from automodel.config.build import ConfigError
    from automodel.planning.job_env import without_keys

    given = [o for o in overrides if o not in without_keys(overrides, LAYOUT_KEYS)]
    if given:
        raise ConfigError(f"plan.search=true chooses the layout itself, but {' '.join(given)} "
                          "sets part of it: drop it (or plan that layout without "
                          "plan.search)")
    return _resolve([*overrides, "mesh.dp_size=1"])


def _base_overrides(cfg) -> list[str]:
    from automodel.planning.job_env import without_keys

    return without_keys(cfg.overrides, ("plan.", *LAYOUT_KEYS))


def _resolve(overrides: list[str]):
    from automodel.config.compose import load_config

    return load_config(overrides, env={"CUDA_VISIBLE_DEVICES": ""})


def _rank_key(e: dict) -> tuple:
    """Faster first; among equally fast (to 4 digits), the smaller peak."""
    return float(f"{e['step_time_s']:.4g}"), e["peak_bytes"]


def run_search(train, gpu: GpuProfile, plan_cfg, out: str, admission=None) -> list[dict]:
    """``admission(base overrides, seq_len)``: the candidates' check before launch (plan.py
    passes ``prepare.admission.Admission``), or None."""
    from automodel.config.build import ConfigError

    if plan_cfg.gpus is None:
        raise ConfigError("plan.search=true needs plan.gpus=<GPUs of the job>")
    admit = admission(_base_overrides(train), train.trainer.seq_len) if admission else None
    result = search_layouts(train, gpu, plan_cfg, admit=admit)
    write_search(result, out)
    print(search_summary(result))
    return result["top"]


def write_search(result: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "search.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def search_layouts(train, gpu: GpuProfile, plan_cfg, keep=None, base=None,
                   admit=None) -> dict:
    """The search of ``plan_cfg.gpus`` GPUs for ``train``'s job: the fastest layouts that fit
    (``top``), the fastest planned in full (``best_planned``), and where none fits the nearest
    misses (``nearest_misses``). ``keep``: which candidates may be chosen (the bounds of
    ``layout=auto``); ``base``: the job's own overrides (default: ``train``'s, without the
    layout keys); ``admit``: a candidate's refusal before launch, or None (the preflight's
    checks, ``prepare/admission.py``; refused layouts are not weighed)."""
    from automodel.config.build import ConfigError
    from automodel.planning.notes import profile_notes

    model = model_facts(train)
    t = train.trainer
    job = {"global_batch": t.global_batch_size, "seq_len": t.seq_len,
           "activation_bytes": 2 if train.mp_policy is not None else 4}
    found = [c for c in candidates(plan_cfg.gpus, gpu.gpus_per_node, model,
                                   t.global_batch_size, t.seq_len) if keep is None or keep(c)]
    if not found:
        raise ConfigError(f"no layout of {plan_cfg.gpus} GPUs takes trainer.global_batch_size="
                          f"{t.global_batch_size}" + (" within the keys set" if keep else "")
                          + ": choose a batch that the data-parallel degrees divide")
    found, refused_before = admitted(found, admit, plan_cfg.gpus)
    probed = _probe_and_estimate(train, found, model, job, gpu, plan_cfg)
    fitting = sorted((e for e in probed.estimates if e["fits"]), key=_rank_key)
    base = _base_overrides(train) if base is None else base
    refused, best = _confirm_fastest(base, fitting, gpu, plan_cfg)
    top = [e for e in fitting if all(e is not r for r in refused)][:plan_cfg.top]
    for e in top + refused:
        e["command"] = " ".join(["python train.py", *base, *e["overrides"]])
    result = {"gpus": plan_cfg.gpus, "gpu": gpu.as_dict(),
              "calibration": dict(plan_cfg.calibration), "searched": len(found),
              "estimated": len(probed.estimates), "pruned": probed.pruned,
              "fitting": len(fitting), "top": top, "refused_in_full": refused,
              "refused_before_launch": refused_before,
              "probes": {key.name: dataclasses.asdict(c) for key, c in probed.costs.items()},
              "notes": profile_notes(gpu.as_dict(), plan_cfg.calibration)}
    if best is not None:
        result["best_planned"] = best["planned"]
    if not fitting:
        from automodel.planning.misses import nearest_misses

        result["nearest_misses"] = nearest_misses(probed.estimates, gpu)
    return result




def _probe_and_estimate(train, found: list, model: dict, job: dict, gpu: GpuProfile,
                        plan_cfg):
    """The estimates of every layout that could rank in the top (``prune.py``): the top shown
    and the ones the full plans may refuse before it."""
    from automodel.planning.probes import run_probes
    from automodel.planning.prune import probe_and_estimate

    workers = plan_cfg.workers or os.cpu_count() or 1
    from automodel.planning.plan import device_path

    def resolve(overrides):  # (the optimizer's path on the planned device)
        return device_path(_resolve(overrides), gpu)

    return probe_and_estimate(
        found, lambda keys, wide: run_probes(train, keys, resolve, plan_cfg.workers, wide),
        lambda c, costs: estimate(c, costs, model, job, gpu, plan_cfg.calibration),
        keep=plan_cfg.top + CONFIRM_TRIES - 1, batch=2 * workers)


def _confirm_fastest(base: list[str], fitting: list[dict], gpu: GpuProfile, plan_cfg):
    """(the fastest estimates that the full plan found not to fit, the first that it
    confirmed or None): each planned in full in turn, up to ``CONFIRM_TRIES``."""
    refused = []
    for e in fitting[:CONFIRM_TRIES]:
        e["planned"] = _confirm(base, e, gpu, plan_cfg)
        if e["planned"]["fits"]:
            return refused, e
        refused.append(e)
    return refused, None


def _confirm(base: list[str], best: dict, gpu: GpuProfile, plan_cfg) -> dict:
    """The layout planned in full, by the simulation of the pipeline ranks (rank classes)
    that decide it: the one of the largest estimated peak and the slowest (every class of a
    plan would cost each pipeline rank's simulation; ``plan.py`` plans them all)."""
    from automodel.costing.calibrate import check_entry
    from automodel.planning.plan import make_plan

    ranks = best["ranks"]
    only = sorted({max(range(len(ranks)), key=lambda i: ranks[i]["peak_bytes"]),
                   max(range(len(ranks)), key=lambda i: ranks[i]["time"]["step_time_s"])})
    plan = make_plan(_resolve(base + best["overrides"]), gpu, plan_cfg.calibration,
                     plan_cfg.workers, full_depth=plan_cfg.full_depth, only=only)
    return {"step_time_s": plan["step_time_s"], "fits": plan["fits"],
            "peak_bytes": max(r["peak_bytes"] for r in plan["ranks"]),
            "ranks_planned": [r["name"] for r in plan["ranks"]],
            "estimated_peak_bytes": best["peak_bytes"],
            "estimated_step_time_s": best["step_time_s"], "warnings": plan["warnings"],
            "check": check_entry(plan)}
