"""A job's plan: its rank classes simulated, costed on a GPU profile, and judged.

``make_plan(cfg, profile)`` returns the dict written to ``plan.json`` (docs/planning.md lists its
fields). A rank class is a set of ranks that hold the same pieces of the model and do the
same work: one per pipeline rank (its stages); every data-, context-, tensor- and
expert-parallel position of a stage holds an equal share, so one rank stands for all of
them (the first: where FSDP's shards are uneven it holds the larger one).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from dataclasses import dataclass

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig
from automodel.costing import cost
from automodel.costing.gpus import GpuProfile
from automodel.planning.job_env import simulation_modules
from automodel.planning.notes import plan_notes
from automodel.planning.warnings import plan_warnings


@dataclass(frozen=True)
class RankClass:
    name: str
    rank: int  # the rank simulated
    count: int  # ranks like it


def rank_classes(cfg: TrainConfig) -> list[RankClass]:
    layout = cfg.layout
    if layout.pp == 1:
        return [RankClass("every rank", 0, layout.world_size)]
    return [RankClass(f"pp rank {i}", i * layout.per_stage, layout.per_stage)
            for i in range(layout.pp)]


TRACEBACK_LINES = 40  # of a failed simulation's, in its error
# a simulation's build (model, parallelize, optimizer states) against one layer-micro-batch
BUILD_WEIGHT = 5


class SimulationError(RuntimeError):
    """A rank class's simulation failed: the message names the class, the layout and the
    worker's own exception (its traceback, as text)."""


def simulate_classes(cfg: TrainConfig, classes: list[RankClass],
                     workers: int | None = None, full_depth: bool = False) -> list[dict]:
    """Each class's rank simulated in a fresh process (a process group each), in parallel; a
    deep model of alike layers as two shallow copies, extended to its depth
    (``planning/depth.py``), and a pipeline of many micro-batches as two short runs of its
    schedule, extended to its count (``planning/microbatches.py``; both: the deeper copy's
    longer run made of the others', ``microbatches.corner``), unless ``full_depth``."""
    from automodel.planning.depth import extend
    from automodel.planning.microbatches import corner

    pair, depths, runs, counts = planned_runs(cfg, full_depth)
    tasks = [(i, j, k) for i in range(len(classes)) for j, k in runs]
    sims = dict(zip(tasks, simulate_configs(*_task_configs(cfg, classes, tasks, counts, depths),
                                            workers)))
    if pair is not None and depths is not None:  # (the fourth corner)
        d0, d1 = depths[2]
        for i in range(len(classes)):
            sims[i, 1, d1] = corner(sims[i, 0, d0], sims[i, 0, d1], sims[i, 1, d0],
                                    sims[i, 2, d1], pair[:2], counts[2])

    def at_depth(i: int, j: int) -> dict:
        if depths is None:
            return sims[i, j, None]
        a, b = (sims[i, j, k] for k in depths[2])
        held = len(a["stages"])
        return extend(a, b, depths[2][0] * held, depths[2][1] * held,
                      sum(depths[1][s] for s in a["stages"]))

    if pair is None:
        return [at_depth(i, 0) for i in range(len(classes))]
    return [extend(at_depth(i, 0), at_depth(i, 1), *pair) for i in range(len(classes))]


def planned_runs(cfg: TrainConfig, full_depth: bool = False) -> tuple:
    """(the micro-batch pair or None, the depths or None, the runs each class is simulated at
    as (count index, layers per stage or None), the counts the indices name (None: the job's)):
    the two short schedules where they cost less than the whole one (``weight``)."""
    from automodel.planning.depth import shallow_depths
    from automodel.planning.microbatches import microbatch_pair

    pair = None if full_depth else microbatch_pair(cfg)
    depths = None if full_depth else shallow_depths(cfg)
    whole = short_runs(cfg, None, depths)
    if pair is None:
        return None, depths, *whole
    short = short_runs(cfg, pair, depths)

    def cost(runs, counts):
        return sum(weight(k, counts[j] or pair[2]) for j, k in runs)

    return (pair, depths, *short) if cost(*short) < cost(*whole) else (None, depths, *whole)


def weight(k: int | None, count: int | None) -> int:
    """The estimated cost of a simulation of ``count`` micro-batches (None: one) and ``k``
    layers a stage (None: the model's, one here): its build, and its layers times its
    micro-batches (the 70B's interleaved rank of two stages: about 1.2 s and 0.25 s)."""
    return BUILD_WEIGHT + (k or 1) * (count or 1)


def short_runs(cfg: TrainConfig, pair, depths) -> tuple[list, list]:
    """(the runs each class is simulated at, as (count index, layers per stage or None), the
    micro-batch counts the indices name (None: the job's))."""
    from automodel.planning.microbatches import few_microbatches

    per_stage = [None] if depths is None else list(depths[2])
    if pair is None:
        return [(0, k) for k in per_stage], [None]
    counts = [pair[0], pair[1], few_microbatches(cfg)]
    if depths is None:
        return [(0, None), (1, None)], counts
    d0, d1 = per_stage
    return [(0, d0), (0, d1), (1, d0), (2, d1)], counts


def _task_configs(cfg: TrainConfig, classes: list, tasks: list, counts: list, depths) -> tuple:
    """(configs, ranks, names, weights) of the tasks, for ``simulate_configs``."""
    from automodel.planning.depth import shallow_config
    from automodel.planning.microbatches import with_microbatches

    configs, names, weights = [], [], []
    for i, j, k in tasks:
        c = cfg if counts[j] is None else with_microbatches(cfg, counts[j])
        configs.append(c if k is None else shallow_config(c, k, depths[0]))
        names.append(classes[i].name + ("" if counts[j] is None
                                        else f" ({counts[j]} micro-batches)"))
        weights.append(weight(k, counts[j]))
    return configs, [classes[i].rank for i, _, _ in tasks], names, weights


def simulate_configs(configs: list, ranks: list[int], names: list[str] | None = None,
                     weights: list[float] | None = None, workers: int | None = None,
                     together: int = 1) -> list[dict]:
    """``simulate_rank(configs[i], ranks[i])`` for every i, in fresh processes: each
    ``together`` consecutive simulations in one (torch's caches of fake-tensor dispatch, kept
    across them, make the later ones faster: a quarter of the probes' time; the caches keyed by
    meshes are emptied after each, ``forget_meshes``); with ``weights`` (each simulation's
    estimated cost), one a process, the heaviest started first (the workers then end
    together). A failure raises ``SimulationError`` naming the task
    (``names[i]``, else its rank) and its layout, with the worker's exception (a
    ``ConfigError`` stays one)."""
    workers = workers or os.cpu_count() or 1
    groups = [[i] for i in sorted(range(len(configs)), key=lambda i: -weights[i])] \
        if weights is not None else [list(range(i, min(i + together, len(configs))))
                                     for i in range(0, len(configs), together)]
    tasks = [[(configs[i], ranks[i]) for i in g] for g in groups]
    from automodel.runtime import forkserver

    # (forked from a server that imported torch, the planner and the model's code once)
    context = forkserver.context(simulation_preload(configs[0]))
    out: list = [None] * len(configs)
    with concurrent.futures.ProcessPoolExecutor(min(len(tasks), workers), mp_context=context,
                                                max_tasks_per_child=1) as pool:
        futures = [pool.submit(_simulate_all, task) for task in tasks]
        for group, future in zip(groups, futures):
            try:
                for i, sim in zip(group, future.result()):
                    out[i] = sim
            except ConfigError:
                raise
            except Exception as err:  # (a simulation's, or a worker that died)
                for f in futures:
                    f.cancel()
                failed = err if isinstance(err, _TaskFailed) else _TaskFailed(0, str(err))
                i = group[failed.index]
                name = names[i] if names else f"rank {ranks[i]}"
                raise SimulationError(
                    f"the simulation of {name} (rank {ranks[i]}) failed, layout "
                    f"{layout_text(configs[i])}:\n{failed.text}") from None
    return out


def simulation_preload(cfg: TrainConfig) -> tuple:
    """What a simulation worker of ``cfg``'s model imports (``job_env.simulation_modules``)."""
    from automodel.models.builder import hf_config

    return simulation_modules(hf_config(cfg.model).model_type)


class _TaskFailed(Exception):
    """A worker's simulation failed: which of its task's, and the exception as text (not
    every exception pickles)."""

    def __init__(self, index: int, text: str):
        super().__init__(index, text)
        self.index, self.text = index, text


def _simulate_all(task: list) -> list[dict]:
    out = []
    for i, (cfg, rank) in enumerate(task):
        try:
            out.append(_simulate(cfg, rank))
        except ConfigError:
            raise
        except Exception as err:
            raise _TaskFailed(i, str(err)) from None
    return out


def _simulate(cfg: TrainConfig, rank: int) -> dict:
    import traceback
    import warnings

    from automodel.planning.simulate import as_dict, simulate_rank

    warnings.filterwarnings("ignore")  # (FSDP2's view-output caution, on every forward)
    # (DTensor's advice to flatten the mesh for a norm over two axes: once per worker)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    try:
        return as_dict(simulate_rank(cfg, rank))
    except ConfigError:
        raise
    except Exception as err:  # (sent back as text: not every exception pickles)
        lines = "".join(traceback.format_exception(err)).rstrip().splitlines()
        cut = [f"... ({len(lines) - TRACEBACK_LINES} lines before)"] \
            if len(lines) > TRACEBACK_LINES else []
        raise RuntimeError("\n".join(cut + lines[-TRACEBACK_LINES:])) from None


def device_path(cfg: TrainConfig, profile: GpuProfile) -> TrainConfig:
    """``cfg`` as it runs on ``profile``'s device: on a GPU, AdamW takes its multi-tensor path
    (``optim.foreach`` null: torch's choice there), whose temporaries the simulation then
    counts; CPU ranks keep the per-parameter loop."""
    import dataclasses

    if profile.name == "cpu" or cfg.optim.foreach is not None or cfg.cpu_offload:
        return cfg  # (offloaded: the optimizer steps on the host's copies, as on the CPU)
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, foreach=True))


def layout_text(cfg: TrainConfig) -> str:
    """The layout in a few words: ``parallelism=fsdp2 pipeline=1f1b pp 2 x dp_shard 4``."""
    lay = layout_dict(cfg)
    sizes = " x ".join(f"{k} {lay[k]}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp",
                                                  "ep") if lay[k] > 1) or "1 rank"
    return f"parallelism={lay['strategy']} pipeline={lay['pipeline']} {sizes}"


def make_plan(cfg: TrainConfig, profile: GpuProfile, calibration: dict | None = None,
              workers: int | None = None, simulations: list[dict] | None = None,
              full_depth: bool = False, only: list[int] | None = None) -> dict:
    """The plan of ``cfg`` on ``profile`` GPUs. ``simulations``: the classes' simulations
    when already made (the search re-costs them); ``only``: the indices of the rank classes
    to simulate, the others left out of the plan (the search's check of its estimate)."""
    cfg = device_path(cfg, profile)
    classes = rank_classes(cfg)
    if only is not None:
        classes = [classes[i] for i in only]
    if simulations is None:
        from automodel.planning.supported import check_plannable

        check_plannable(cfg)  # (before any simulation starts)
    sims = simulations if simulations is not None else simulate_classes(cfg, classes, workers,
                                                                           full_depth)
    pipeline = pipeline_summary(cfg)
    bubble = pipeline["bubble"] if pipeline else 0.0
    sizes = cost.mesh_sizes(cfg.layout)
    ranks = [_rank_entry(c, s, profile, sizes, bubble, calibration)
             for c, s in zip(classes, sims)]
    slowest = max(ranks, key=lambda r: r["time"]["step_time_s"])
    tokens = cfg.trainer.global_batch_size * cfg.trainer.seq_len
    plan = {
        "command": command_line(cfg), "world_size": cfg.layout.world_size,
        "layout": layout_dict(cfg), "model": model_summary(cfg),
        "batch": {"global_batch_size": cfg.trainer.global_batch_size,
                  "local_batch_size": cfg.trainer.local_batch_size,
                  "seq_len": cfg.trainer.seq_len, "grad_accum_steps": cfg.grad_accum_steps},
        "gpu": profile.as_dict(), "calibration": dict(calibration or {}),
        "ranks": ranks,
        "comm_bytes_per_step": max((r["comm_bytes_per_step"] for r in ranks),
                                   key=lambda c: sum(sum(k.values()) for k in c.values())),
        "bubble": bubble, "pipeline": pipeline,
        "flops_per_step": sum(r["flops"] * r["count"] for r in ranks),
        "step_time_s": slowest["time"]["step_time_s"], "time": slowest["time"],
        "tokens_per_s": tokens / slowest["time"]["step_time_s"],
        "overhead_bytes": max(r["overhead_bytes"] for r in ranks),
        "fits": all(r["fits"] for r in ranks),
    }
    plan["warnings"] = plan_warnings(plan, cfg, profile)
    plan["notes"] = plan_notes(cfg, plan)
    return plan


def _rank_entry(c: RankClass, sim: dict, profile: GpuProfile, sizes: dict, bubble: float,
                calibration: dict | None) -> dict:
    stages = sim["stages"]
    name = c.name if len(stages) < 2 or not c.name.startswith("pp") else \
        f"{c.name} (stages {', '.join(map(str, stages))})"
    time = cost.step_time(sim["flops"], sim["comm"], sizes, profile, bubble, calibration)
    peak = sim["peak_bytes"]
    return {"name": name, "count": c.count, "example_rank": c.rank, "stages": stages,
            "peak_bytes": peak, "memory": sim["memory"], "memory_detail": sim["detail"],
            "host_bytes": sim.get("host_bytes", 0), "host_memory": sim.get("host_memory", {}),
            "peak_bytes_device_and_host": sim.get("combined_peak_bytes") or peak,
            "recv_buffer_bytes": sim["recv_buffer_bytes"], "flops": sim["flops"],
            "comm_bytes_per_step": sim["comm"], "comm_calls_per_step": sim["comm_calls"],
            "time": time.as_dict(),
            "overhead_bytes": profile.overhead(peak),
            "headroom_bytes": profile.headroom(peak), "fits": profile.headroom(peak) >= 0}


def pipeline_summary(cfg: TrainConfig) -> dict | None:
    """The schedule this job's pipeline runs (torch's own, lowered to its actions): its
    micro-batches, its bubble (idle share of the ranks' time, forward 1, backward 2) and the
    micro-batches each stage holds at once. None without a pipeline."""
    if cfg.pipeline is None:
        return None
    from automodel.distributed.pipelining.bubble import (
        bubble_fraction,
        in_flight,
        schedule_timeline,
    )

    p = cfg.pipeline
    batch = p.pp_batch_size or cfg.layout.per_rank_batch(cfg.trainer.global_batch_size)
    n = batch // p.pp_microbatch_size
    timeline = schedule_timeline(p, cfg.layout.pp, n)
    return {"schedule": cfg.choices.get("pipeline", p.pp_schedule), "microbatches": n,
            "stages": timeline.num_stages, "bubble": bubble_fraction(timeline),
            "in_flight": in_flight(timeline)}


def layout_dict(cfg: TrainConfig) -> dict:
    lay = cfg.layout
    return {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
            "cp": lay.cp, "cp_ulysses": lay.cp_ulysses, "tp": lay.tp, "ep": lay.ep,
            "strategy": cfg.strategy.name,
            "pipeline": cfg.choices.get("pipeline", "none") if cfg.pipeline else "none",
            "activation_checkpointing": cfg.activation_checkpointing}


def model_summary(cfg: TrainConfig) -> dict:
    from automodel.peft import adapted_meta_model

    model = adapted_meta_model(cfg)
    params = {id(p): p for p in model.parameters()}.values()
    return {"name": cfg.choices.get("model", type(model).__name__),
            "class": type(model).__name__,
            "parameters": sum(p.numel() for p in params),
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad)}


def command_line(cfg: TrainConfig) -> str:
    """The train.py command line that runs what this plan describes: the overrides planned,
    with the mesh spelled out (so the layout does not depend on the world it starts in)."""
    return " ".join(["python train.py", *spelled_overrides(cfg)])


def spelled_overrides(cfg: TrainConfig) -> list[str]:
    """``cfg``'s overrides with its mesh spelled out (``command_line``'s)."""
    lay = cfg.layout
    mesh = {"dp_size": lay.dp, "dp_replicate_size": lay.dp_replicate, "tp_size": lay.tp,
            "cp_size": lay.cp, "cp_ulysses_size": lay.cp_ulysses, "pp_size": lay.pp,
            "ep_size": lay.ep}
    from automodel.planning.job_env import without_keys

    kept = without_keys(cfg.overrides, ("mesh.", "plan."))
    spelled = [f"mesh.{k}={v}" for k, v in mesh.items()
               if v > 1 or k in ("dp_size", "pp_size") and cfg.pipeline is not None]
    return [*kept, *spelled]
