"""``layout=auto``: the planner's search chooses the job's layout for the GPUs (or CPU ranks) it
runs on, once, before any rank starts, and the job trains on it.

- **Size**: the job's world as launching resolves it (``distributed.nproc_per_node``, else the
  local GPUs; one node). Ranks that an outer launcher started (torchrun, a plain srun) would
  each search alone: refused, naming the launches that search once.
- **Bounds**: the layout keys the user set (``mesh.tp_size=2``, ``pipeline=1f1b``, the
  checkpointing mode, the micro-batch) keep only the layouts that agree; with every one set
  there is nothing to choose, and ``layout=auto`` is refused as a conflict.
- **Profile**: the ranks' device (``device_profiles.py``): the local GPUs', else the CPU
  ranks' own; under SLURM the nodes' GRES type, else their memory.
- **Result**: the fastest layout that fits, printed with its command line; ``search.json`` and
  ``plan.json`` beside the run; the run's config (``.hydra/config.yaml``) is the chosen
  layout's, so a rerun without ``auto`` is the same job. No layout fits: refused before launch,
  with the three nearest misses and what each lacks.
- **Cache**: a search of the same model, shapes, precision, adapters, bounds and GPUs is
  reused (``$AUTOMODEL_CACHE/layout/``, else ``~/.cache/automodel/layout/``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from pathlib import Path

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig
from automodel.prepare.device_profiles import local_profile, slurm_profile

log = logging.getLogger("automodel")

SCHEDULES = ("none", "1f1b", "interleaved")  # the pipelines a search tries
# the keys that fix the whole layout: with all of them set, layout=auto has nothing to choose
FIXING = ("tp", "pp", "dp", "schedule", "ac", "mbs")


AUTO_CHECK_STEPS = 10  # layout=auto's default trainer.plan_check_steps


def auto_check_overrides(cfg: TrainConfig) -> list[str]:
    """The ``trainer.plan_check_steps`` a ``layout=auto`` job runs with (the user's, else
    ``AUTO_CHECK_STEPS`` within its steps; fewer than 3 steps: off)."""
    if any(o.lstrip("+").startswith("trainer.plan_check_steps=") for o in cfg.overrides):
        return []
    steps = min(AUTO_CHECK_STEPS, cfg.trainer.max_steps)
    return [f"trainer.plan_check_steps={steps if steps >= 3 else 0}"]


def bounds_of(overrides: list[str]) -> dict:
    """{dimension: value} of the layout keys among ``overrides`` (the searched dimensions:
    tp, pp, cp, ep, dp, dp_replicate, schedule, ac, mbs, sp)."""
    from automodel.config.enums import ACMode

    names = {"mesh.tp_size": "tp", "mesh.pp_size": "pp", "mesh.cp_size": "cp",
             "mesh.ep_size": "ep", "mesh.dp_size": "dp", "mesh.dp_replicate_size":
             "dp_replicate", "trainer.local_batch_size": "mbs",
             "pipeline.pp_microbatch_size": "mbs"}
    bounds: dict = {}
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key in names and value not in ("null", ""):
            bounds[names[key]] = int(value)
        elif key == "pipeline":
            if value not in SCHEDULES:
                raise ConfigError(f"layout=auto chooses among pipeline={', '.join(SCHEDULES)}; "
                                  f"pipeline={value} is not one of them: drop it, or set the "
                                  "layout yourself (drop layout=auto)")
            bounds["schedule"] = value
        elif key == "parallelism.activation_checkpointing":
            word = {"false": False, "null": False, "true": True}.get(value.lower(), value)
            bounds["ac"] = ACMode.parse(key, word).value
        elif key == "parallelism.sequence_parallel":
            bounds["sp"] = value.lower() == "true"
    return bounds


def allows(bounds: dict):
    """The test a candidate layout passes when it agrees with ``bounds``."""
    def keep(c) -> bool:
        have = {"tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "dp_replicate": c.dp_replicate,
                "dp": c.dp_replicate * c.dp_shard, "schedule": c.schedule, "ac": c.ac,
                "mbs": c.mbs, "sp": c.sp and c.tp > 1}
        return all(have[k] == v for k, v in bounds.items() if not (k == "sp" and c.tp == 1))
    return keep


def check_bounds(bounds: dict, keys: list[str]) -> None:
    if all(k in bounds for k in FIXING):
        raise ConfigError(f"layout=auto with the whole layout set ({' '.join(keys)}): the search "
                          "has nothing to choose. Drop layout=auto to train this layout, or drop "
                          "the keys the search should choose")


def choose_layout(cfg: TrainConfig, compose_and_resolve) -> TrainConfig:
    """``cfg`` (``layout=auto``) on the layout the search chooses: ``compose_and_resolve``
    turns a list of overrides into the job's ``TrainConfig`` (its output directory and
    environment kept)."""
    if cfg.launch.external:
        raise ConfigError(f"layout=auto under {cfg.launch.kind}: each rank would search alone. "
                          "The search runs once, before the ranks start: launch with python "
                          "train.py (local ranks) or python train.py -m hydra/launcher=slurm; "
                          "or plan.py plan.search=true and set the layout")
    world = cfg.layout.world_size
    gpu = local_profile(cfg)
    base = _base(cfg.overrides) + auto_check_overrides(cfg)
    base += [f"distributed.nproc_per_node={world}"] if world > 1 else []
    result, chosen = search_and_choose(cfg, base, world, gpu)
    job = compose_and_resolve(base + chosen["overrides"])
    write_choice(job.output_dir, result, chosen)
    return job


def _base(overrides: list[str]) -> list[str]:
    """The job's own overrides: without the layout keys and ``layout=`` itself."""
    from automodel.planning.job_env import without_keys
    from automodel.planning.probes import LAYOUT_KEYS

    return [o for o in without_keys(overrides, LAYOUT_KEYS)
            if not o.lstrip("+").startswith(("layout=", "distributed.nproc_per_node="))]


def search_and_choose(cfg: TrainConfig, base: list[str], world: int, gpu) -> tuple:
    """(the search's result, the chosen layout's estimate) of ``cfg``'s job on ``world``
    devices of ``gpu``, within the layout keys of its overrides."""
    from automodel.planning.job_env import without_keys
    from automodel.planning.probes import LAYOUT_KEYS

    keys = [o for o in cfg.overrides if o not in without_keys(cfg.overrides, LAYOUT_KEYS)]
    bounds = bounds_of(keys)
    check_bounds(bounds, keys)
    result = _search(cfg, base, bounds, world, gpu)
    return result, _chosen(result, world)


def slurm_layout(cfg: TrainConfig, nodes: int, tasks_per_node: int, output_dir: str,
                 partition: str | None) -> list[str]:
    """At submit time: the overrides that put a ``layout=auto`` SLURM job on the layout the
    search chooses for ``nodes`` x ``tasks_per_node`` ranks (``slurm_profile``: the nodes'
    GPUs, else their memory), to append to the job's own (``layout=manual`` last, so
    its tasks do not search again); ``search.json`` and ``plan.json`` in ``output_dir``."""
    world = nodes * tasks_per_node
    gpu = slurm_profile(partition, tasks_per_node)
    check = auto_check_overrides(cfg)
    base = _base(cfg.overrides) + check
    result, chosen = search_and_choose(cfg, base, world, gpu)
    write_choice(output_dir, result, chosen)
    return chosen["overrides"] + check + ["layout=manual"]


def _search(cfg: TrainConfig, base: list[str], bounds: dict, world: int, gpu) -> dict:
    """The search's result, from the cache when the same search ran before."""
    from automodel.config.plan_schema import PlanConfig
    from automodel.planning.search import _resolve, search_layouts
    from automodel.prepare.admission import Admission

    train = _resolve([o for o in base if not o.startswith("distributed.nproc_per_node=")]
                     + ["mesh.dp_size=1", "layout=manual"])
    path = _cache_dir() / f"{search_key(train, gpu, world, bounds)}.json"
    if path.exists():
        log.info("layout=auto: the search of this model, options and %d %s ranks ran before: "
                 "reusing %s", world, gpu.name, path)
        result = json.loads(path.read_text())
        for e in result["top"] + result.get("refused_in_full", []):  # (this job's commands)
            e["command"] = " ".join(["python train.py", *base, *e["overrides"]])
        return result
    from omegaconf import OmegaConf

    from automodel.planning.job_env import start_simulation_server

    # (the probes' workers, and later the ranks, fork from it)
    start_simulation_server(OmegaConf.create({"model": {"config": dict(train.model.config)}}))
    log.info("layout=auto: searching the layouts of %d %s rank%s%s", world, gpu.name,
             "s" if world > 1 else "",
             f" within {', '.join(f'{k}={v}' for k, v in bounds.items())}" if bounds else "")
    result = search_layouts(train, gpu, PlanConfig(gpus=world, search=True, top=3),
                            allows(bounds), base=base,
                            admit=Admission(base, train.trainer.seq_len))
    for why, n in result["refused_before_launch"].items():
        log.info("layout=auto: %d layout%s left out, refused before launch: %s", n,
                 "s" if n > 1 else "", why)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return result


# what a plan does not depend on: left out of a search's cache key (everything else is in it)
NOT_PLANNED = {"logger": None, "checkpoint": None, "experiment": None, "layout": None,
               "trainer": ("max_steps", "seed", "log_every", "stop_at_step", "on_nonfinite",
                           "eval_every", "eval_batches", "profile_steps", "plan_check_steps"),
               "distributed": ("timeout_minutes", "startup_timeout_minutes", "nproc_per_node",
                               "preflight_step", "stop_grace_seconds", "max_restarts")}


def search_key(train: TrainConfig, gpu, world: int, bounds: dict) -> str:
    """The cache key of a search: the job's whole composed config but what a plan does not
    depend on (``NOT_PLANNED``), a pretrained model by its ``config.json``'s content (not
    its path), the device profile, the ranks and the bounds."""
    plain = copy.deepcopy(train.resolved)
    for group, keys in NOT_PLANNED.items():
        if keys is None:
            plain.pop(group, None)
        else:
            for key in keys:
                (plain.get(group) or {}).pop(key, None)
    model = plain.get("model") or {}
    path = model.pop("pretrained_path", None)
    if path is not None:
        with open(os.path.join(path, "config.json"), "rb") as f:
            model["config.json"] = hashlib.sha256(f.read()).hexdigest()
    return hashlib.sha256(json.dumps({
        "config": plain, "strategy": train.strategy.name, "gpu": gpu.as_dict(), "world": world,
        "bounds": bounds, "version": 3}, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cache_dir() -> Path:
    root = os.environ.get("AUTOMODEL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "automodel") / "layout"


def _chosen(result: dict, world: int) -> dict:
    """The fastest layout that fits, or a refusal with the nearest misses."""
    if result["top"]:
        return result["top"][0]
    from automodel.planning.search_text import layout_words

    misses = "\n".join(f"  {i}. {layout_words(m['candidate'])}: needs {m['lacks']}"
                       for i, m in enumerate(result.get("nearest_misses", []), 1))
    raise ConfigError(f"layout=auto: no layout of {world} {result['gpu']['name']} rank"
                      f"{'s' if world > 1 else ''} fits this job ({result['searched']} tried). "
                      f"The nearest misses:\n{misses}\nUse more GPUs, adapters (peft=lora), "
                      "a shorter trainer.seq_len or a smaller batch")


def write_choice(output_dir: str, result: dict, chosen: dict) -> None:
    """search.json and plan.json beside the run, and the chosen layout said."""
    from automodel.planning.search import write_search
    from automodel.planning.search_text import layout_words

    write_search(result, output_dir)
    plan = {"layout": chosen["candidate"], "overrides": chosen["overrides"],
            "command": chosen["command"], "estimate": chosen,
            "planned": result.get("best_planned")}
    if plan["planned"] and "check" in plan["planned"]:  # (what the run compares itself with)
        plan["planned"] = dict(plan["planned"])
        plan["check"] = plan["planned"].pop("check")
    with open(os.path.join(output_dir, "plan.json"), "w") as f:
        json.dump(plan, f, indent=1)
    peak = chosen["peak_bytes"]
    log.info("layout=auto chose %s: %.3g s/step, peak %s per rank predicted (search.json, "
             "plan.json); the same job without the search: %s",
             layout_words(chosen["candidate"]), chosen["step_time_s"],
             f"{peak / 2**30:.2f} GiB" if peak >= 2**30 else f"{peak / 2**20:.1f} MiB",
             chosen["command"])
