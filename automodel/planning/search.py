"""``plan.search=true``: the layouts of ``plan.gpus`` GPUs that fit, fastest first.

1. Enumerate: dp_replicate x dp_shard x tp x pp (tp within a node and dividing the attention
   heads; HSDP replicas of whole nodes), the schedule (1F1B or interleaved with 2 stages per
   rank), activation checkpointing (none, selective, full) and the micro-batch size (1, 2, 4
   sequences) at the job's global batch. (Context and expert parallelism are not searched:
   plan such layouts one by one.)
2. Estimate each from probes (``probes.py``: one layer's simulated costs per tp and
   checkpointing mode) and the schedule's own timeline (its bubble, the micro-batches each
   stage holds): memory per pipeline rank, bytes per axis, FLOPs, then the cost model.
3. Drop what does not fit, rank by step time, and plan the best one in full (``make_plan``: the
   real simulation) to confirm it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass

from automodel.config.layout import Layout
from automodel.config.pipeline_layout import stage_layer_ranges
from automodel.planning import cost
from automodel.planning.gpus import GiB, GpuProfile
from automodel.planning.probes import LAYOUT_KEYS, ac_value

AC_MODES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4)


@dataclass(frozen=True)
class Candidate:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    schedule: str  # none | 1f1b | interleaved
    ac: str
    mbs: int  # sequences per micro-batch

    @property
    def probe(self) -> tuple[int, str, bool]:
        """The probe it is estimated from (``probes.run_probes``' key)."""
        return self.tp, self.ac, self.dp_replicate > 1

    @property
    def layout(self) -> Layout:
        return Layout(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                      tp=self.tp)

    def overrides(self) -> list[str]:
        out = [f"mesh.dp_size={self.dp_replicate * self.dp_shard}", f"mesh.tp_size={self.tp}",
               f"parallelism.activation_checkpointing={ac_value(self.ac)}"]
        out += [f"mesh.dp_replicate_size={self.dp_replicate}"] if self.dp_replicate > 1 else []
        out += ["parallelism.sequence_parallel=true"] if self.tp > 1 else []
        if self.pp > 1:
            return out + [f"pipeline={self.schedule}", f"mesh.pp_size={self.pp}",
                          f"pipeline.pp_microbatch_size={self.mbs}"]
        return out + ["pipeline=none", f"trainer.local_batch_size={self.mbs}"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(gpus: int, gpus_per_node: int, heads: int, kv_heads: int, layers: int,
               global_batch: int) -> list[Candidate]:
    out = []
    for tp in [t for t in divisors(gpus_per_node) if heads % t == 0 and kv_heads % t == 0]:
        for pp in [p for p in divisors(gpus // tp) if p <= layers]:
            dp = gpus // (tp * pp)
            if global_batch % dp:
                continue
            for replicate in _replicas(dp, tp, pp, gpus_per_node):
                for schedule in (("1f1b", "interleaved") if pp > 1 else ("none",)):
                    if schedule == "interleaved" and layers < 2 * pp:
                        continue
                    for mbs in MICRO_BATCHES:
                        per_rank = global_batch // dp
                        if per_rank % mbs or (pp > 1 and per_rank // mbs < pp):
                            continue
                        out += [Candidate(replicate, dp // replicate, tp, pp, schedule, ac, mbs)
                                for ac in AC_MODES]
    return out


def _replicas(dp: int, tp: int, pp: int, gpus_per_node: int) -> list[int]:
    """1 (FSDP over every data-parallel rank), and HSDP sharding within a node when that
    splits dp (each replica a node's worth of ranks)."""
    shard = gpus_per_node // tp if gpus_per_node % tp == 0 else 0
    return [1] + ([dp // shard] if shard and dp % shard == 0 and 1 < shard < dp else [])


@functools.lru_cache(maxsize=None)
def _schedule(pipeline_name: str, pp: int, microbatches: int):
    """(bubble, micro-batches held per stage, stages of each rank, stage count) of the
    schedule."""
    from automodel.config.schema import PipelineConfig
    from automodel.planning.bubble import bubble_fraction, in_flight, schedule_timeline

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
    scale = 2 / c.dp_shard  # probes shard their state over 2 ranks (probes.PROBE_DP)
    n = sum(layers[s] for s in stages)
    head = n_stages - 1 in stages  # (with the loss, whose logits grow with the micro-batch)
    ends = (0 in stages) * model["embed_share"] + (n_stages - 1 in stages) * model["head_share"]
    state = (costs.layer_state * n + costs.rest_state * (ends if c.pp > 1 else 1)) * scale
    activations = costs.layer_activation * c.mbs * sum(layers[s] * held[s] for s in stages) \
        + costs.layer_fixed * n
    flops = (costs.layer_flops * n + costs.rest_flops * head) * c.mbs * micro
    comm = _rank_comm(c, costs, n, micro, head)
    if c.pp > 1:
        p2p = c.mbs * job["seq_len"] * model["hidden"] * job["activation_bytes"] * micro
        comm["pp"] = {"send": p2p * len(stages), "recv": p2p * len(stages)}
    # the rest of the peak (the loss, the head's gradient...) is the probe's, on the rank with
    # the head: its part per sequence (measured with two) grows with the micro-batch
    rest = costs.rest_peak * c.mbs * (c.pp == 1 or head)
    peak = state + activations + costs.rest_fixed + rest
    if micro > 1:  # FSDP2 keeps unsharded gradients between micro-batches (it reduces once)
        rs = [costs.layer_comm, costs.rest_comm]
        layer_rs, rest_rs = (x.get("dp_shard", {}).get("reduce_scatter", 0) for x in rs)
        peak += layer_rs * n + rest_rs * (ends if c.pp > 1 else 1)
    # the optimizer's step: the sharded states, gradients and the step's temporaries
    stepping = (costs.layer_optimizer_peak * n
                + costs.rest_optimizer_peak * (ends if c.pp > 1 else 1)) * scale
    return {"stages": list(stages), "layers": n, "peak_bytes": int(max(peak, stepping)),
            "flops": flops, "comm": comm}


def _rank_comm(c: Candidate, costs, n: int, micro: int, head: bool) -> dict:
    """Tensor-parallel traffic per layer and micro-batch; FSDP gathers each layer per
    micro-batch and reduce-scatters its gradients once per step; HSDP all-reduces the shards
    across replicas."""
    comm: dict = {}
    for axis, kinds in costs.layer_comm.items():
        for kind, b in kinds.items():
            rest = costs.rest_comm.get(axis, {}).get(kind, 0) * head
            if axis == "tp":
                comm.setdefault("tp", {})[kind] = (b * n + rest) * c.mbs * micro
            elif kind == "all_gather" and c.dp_shard > 1:
                comm.setdefault("dp_shard", {})[kind] = b * n * micro
            elif kind == "reduce_scatter" and c.dp_shard > 1:
                comm.setdefault("dp_shard", {})[kind] = b * n
    grads = costs.layer_comm.get("dp_shard", {}).get("reduce_scatter", 0) * n
    if c.dp_replicate > 1:
        comm["dp_replicate"] = {"all_reduce": grads / c.dp_shard}
    return comm


def model_facts(cfg) -> dict:
    """What the estimate needs of the model: its layers and width, its heads, and how its
    non-layer state splits between the first stage (embedding) and the last (head)."""
    from automodel.models import multimodal as mm
    from automodel.models.builder import build_meta_model

    meta = build_meta_model(cfg.model)
    text = mm.text_config(meta.config)
    tied = bool(getattr(text, "tie_word_embeddings", False))
    return {"layers": text.num_hidden_layers, "hidden": text.hidden_size,
            "heads": text.num_attention_heads,
            "kv_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            # untied: the embedding and the head are equal; tied: each end holds a copy
            "embed_share": 1.0 if tied else 0.5, "head_share": 1.0 if tied else 0.5}


def resolve_for_search(overrides: list[str]):
    """The job's own settings (model, data, precision, batch, ...) resolved as one rank: its
    layout is what the search chooses, so none may be given."""
    from automodel.config.build import ConfigError
    from automodel.planning.cli import without_keys

    given = [o for o in overrides if o not in without_keys(overrides, LAYOUT_KEYS)]
    if given:
        raise ConfigError(f"plan.search=true chooses the layout itself, but {' '.join(given)} "
                          "sets part of it: drop it (or plan that layout without "
                          "plan.search)")
    return _resolve([*overrides, "mesh.dp_size=1"])


def _base_overrides(cfg) -> list[str]:
    from automodel.planning.cli import without_keys

    return without_keys(cfg.overrides, ("plan.", *LAYOUT_KEYS))


def _resolve(overrides: list[str]):
    from automodel.api import load_config

    return load_config(overrides, env={"CUDA_VISIBLE_DEVICES": ""})


def _rank_key(e: dict) -> tuple:
    """Faster first; among equally fast (to 4 digits), the smaller peak."""
    return float(f"{e['step_time_s']:.4g}"), e["peak_bytes"]


def run_search(train, gpu: GpuProfile, plan_cfg, out: str) -> list[dict]:
    from automodel.config.build import ConfigError
    from automodel.planning.probes import run_probes

    if plan_cfg.gpus is None:
        raise ConfigError("plan.search=true needs plan.gpus=<GPUs of the job>")
    model = model_facts(train)
    t = train.trainer
    job = {"global_batch": t.global_batch_size, "seq_len": t.seq_len,
           "activation_bytes": 2 if train.mp_policy is not None else 4}
    found = candidates(plan_cfg.gpus, gpu.gpus_per_node, model["heads"], model["kv_heads"],
                       model["layers"], t.global_batch_size)
    if not found:
        raise ConfigError(f"no layout of {plan_cfg.gpus} GPUs takes trainer.global_batch_size="
                          f"{t.global_batch_size}: choose a batch that the data-parallel "
                          "degrees divide")
    costs = run_probes(train, sorted({c.probe for c in found}), _resolve, plan_cfg.workers)
    ranked = sorted((estimate(c, costs[c.probe], model, job, gpu, plan_cfg.calibration)
                     for c in found), key=_rank_key)
    fitting = [e for e in ranked if e["fits"]]
    base = _base_overrides(train)
    refused, best = _confirm_fastest(base, fitting, gpu, plan_cfg)
    top = [e for e in fitting if all(e is not r for r in refused)][:plan_cfg.top]
    for e in top + refused:
        e["command"] = " ".join(["python train.py", *base, *e["overrides"]])
    result = {"gpus": plan_cfg.gpus, "gpu": gpu.as_dict(), "searched": len(found),
              "fitting": len(fitting), "top": top, "refused_in_full": refused,
              "probes": {f"tp{tp}_{ac}{'_hsdp' * r}": dataclasses.asdict(c)
                         for (tp, ac, r), c in costs.items()}}
    if best is not None:
        result["best_planned"] = best["planned"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "search.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(search_summary(result))
    return result["top"]


CONFIRM_TRIES = 3  # estimates planned in full, fastest first, until one fits


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
    """The best layout planned in full (the simulation of every rank class)."""
    from automodel.planning.plan import make_plan

    plan = make_plan(_resolve(base + best["overrides"]), gpu, plan_cfg.calibration,
                     plan_cfg.workers, full_depth=plan_cfg.full_depth)
    return {"step_time_s": plan["step_time_s"], "fits": plan["fits"],
            "peak_bytes": max(r["peak_bytes"] for r in plan["ranks"]),
            "estimated_peak_bytes": best["peak_bytes"],
            "estimated_step_time_s": best["step_time_s"], "warnings": plan["warnings"]}


def search_summary(result: dict) -> str:
    lines = [f"search: {result['searched']} layouts of {result['gpus']} x "
             f"{result['gpu']['name']}, {result['fitting']} fit; the fastest:"]
    for i, e in enumerate(result["top"], 1):
        c = e["candidate"]
        lines.append(f" {i}. {e['step_time_s']:.3f} s/step, {e['tokens_per_s']:.0f} tokens/s, "
                     f"peak {e['peak_bytes'] / GiB:.1f} GiB (pp {c['pp']} {c['schedule']}, "
                     f"dp {c['dp_replicate']}x{c['dp_shard']}, tp {c['tp']}, AC {c['ac']}, "
                     f"micro-batch {c['mbs']})\n    {e['command']}")
    for e in result.get("refused_in_full", []):
        p = e["planned"]
        lines.append(f" left out: estimated {e['peak_bytes'] / GiB:.1f} GiB, planned in full "
                     f"{p['peak_bytes'] / GiB:.1f} GiB: does not fit\n    {e['command']}")
    best = result.get("best_planned")
    if best:
        lines.append(f" #1 planned in full: {best['step_time_s']:.3f} s/step, peak "
                     f"{best['peak_bytes'] / GiB:.1f} GiB (estimated "
                     f"{best['estimated_peak_bytes'] / GiB:.1f}), fits")
    elif result["top"] or result.get("refused_in_full"):
        lines.append(f" none of the {CONFIRM_TRIES} fastest fits when planned in full: plan "
                     "the others one by one (their commands above)")
    return "\n".join(lines)
