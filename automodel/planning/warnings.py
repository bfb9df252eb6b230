"""What a plan warns about: a rank class that does not fit (by how much, and what would fix
it), FSDP shards so small their gathers are latency-bound, a large pipeline bubble, tensor
parallelism across nodes, and pipeline stages of unequal work or memory."""

from __future__ import annotations

from automodel.costing import cost
from automodel.costing.gpus import GiB, GpuProfile, MiB

BUBBLE_WARN = 0.20  # of the step
SMALL_GATHER = 1 * MiB  # per rank's shard, per all-gather
STAGE_SPREAD = 0.10  # max/min - 1 of the stages' FLOPs or peak memory


def plan_warnings(plan: dict, cfg, profile: GpuProfile) -> list[str]:
    out = [w for r in plan["ranks"] if not r["fits"] for w in [_does_not_fit(r, cfg, profile)]]
    out += _small_shards(plan, cfg)
    if plan["bubble"] > BUBBLE_WARN:
        p = plan["pipeline"]
        out.append(f"the pipeline bubble is {plan['bubble']:.0%} of the step (over "
                   f"{BUBBLE_WARN:.0%}): {p['microbatches']} micro-batches over "
                   f"{cfg.layout.pp} pipeline ranks; more micro-batches per step (a larger "
                   "trainer.global_batch_size or smaller pipeline.pp_microbatch_size), "
                   "pipeline=interleaved, or a smaller mesh.pp_size shrink it")
    sizes = cost.mesh_sizes(cfg.layout)
    if cfg.layout.tp > 1 and cost.axis_spans_nodes(sizes, "tp", profile.gpus_per_node):
        out.append(f"mesh.tp_size={cfg.layout.tp} crosses nodes of {profile.gpus_per_node} "
                   "GPUs: tensor parallelism then runs on the network; keep tp_size at most "
                   "the GPUs of a node")
    out += _unequal_stages(plan)
    return out


def _does_not_fit(rank: dict, cfg, profile: GpuProfile) -> str:
    short = -rank["headroom_bytes"]
    m = rank["memory"]
    biggest = max(m, key=m.get)
    fixes = {
        "activations": "activation checkpointing (parallelism.activation_checkpointing=full), "
                       "a smaller trainer.local_batch_size, or more tp/cp ranks",
        "optimizer_states": "shard the optimizer over more ranks (parallelism=fsdp2 with a "
                            "larger mesh.dp_size), or more tp/pp ranks",
        "parameters_sharded": "shard parameters over more ranks (fsdp2, larger dp_shard) or "
                              "split them with tp/pp",
        "gradients": "shard gradients (fsdp2) or split the model with tp/pp",
    }.get(biggest, "more model-parallel ranks (tp, pp) or a smaller micro-batch")
    return (f"{rank['name']} does not fit: peak {rank['peak_bytes'] / GiB:.1f} GiB + "
            f"{rank['overhead_bytes'] / GiB:.1f} GiB overhead > {profile.hbm_bytes / GiB:.1f} "
            f"GiB of {profile.name}, short by {short / GiB:.1f} GiB; the largest part is "
            f"{biggest} ({m[biggest] / GiB:.1f} GiB): {fixes}")


def _small_shards(plan: dict, cfg) -> list[str]:
    out = []
    for axis in ("dp_shard", "dp_shard_cp"):
        shard = cfg.layout.size(axis)
        rank = plan["ranks"][0]
        gathered = rank["comm_bytes_per_step"].get(axis, {}).get("all_gather", 0)
        calls = rank["comm_calls_per_step"].get(axis, {}).get("all_gather", 0)
        if shard > 1 and gathered and calls:
            per_rank = gathered / calls / shard
            if per_rank < SMALL_GATHER:
                out.append(f"FSDP shards are small: each {axis} rank holds "
                           f"{per_rank / 1024:.0f} KiB per all-gather ({shard} ranks, "
                           f"{calls} gathers a step); gathers this small are latency-bound: "
                           "use fewer dp_shard ranks (HSDP: mesh.dp_replicate_size) or "
                           "larger FSDP units")
    return out


def _unequal_stages(plan: dict) -> list[str]:
    ranks = plan["ranks"]
    if len(ranks) < 2:
        return []
    out = []
    for key, what in (("flops", "work (FLOPs)"), ("peak_bytes", "peak memory")):
        values = [r[key] for r in ranks]
        if min(values) > 0 and max(values) / min(values) - 1 > STAGE_SPREAD:
            hi, lo = (max(ranks, key=lambda r: r[key]), min(ranks, key=lambda r: r[key]))
            out.append(f"pipeline stages are unequal in {what}: {hi['name']} has "
                       f"{max(values) / min(values):.2f}x {lo['name']}'s; move layers "
                       "(pipeline.layers_per_stage or a pipeline=csv split) to even them")
    return out
