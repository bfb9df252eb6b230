"""``plan.py``'s command line (an entry point: nothing in ``automodel`` imports it): the training
config resolved for the job's world size and checked as a launch would check it, the plan (or
the search) made, ``plan.json`` and ``plan.png`` written; ``load_plan`` does the same from a
list of overrides, for tests and scripts."""

from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace

from automodel.config.build import ConfigError, build
from automodel.config.plan_schema import PlanConfig
from automodel.planning.job_env import planning_env, start_simulation_server, without_keys

log = logging.getLogger("automodel.plan")


def run_plan(cfg, admission=None):
    """plan.py's job; ``admission``: what a search asks of each candidate before launch
    (``prepare.admission.Admission``, given by the entry point)."""
    from hydra.core.hydra_config import HydraConfig

    from automodel.planning.plan import SimulationError

    try:
        return _run(cfg, HydraConfig.get(), admission)
    except ConfigError as err:
        print(f"automodel: configuration error:\n{err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except SimulationError as err:
        print(f"automodel: plan failed: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


def split_plan_node(cfg):
    """(the training config without ``plan``, the ``PlanConfig``)."""
    from omegaconf import OmegaConf, open_dict

    train = cfg.copy()
    with open_dict(train):
        node = train.pop("plan")
    plan = build(PlanConfig, OmegaConf.to_container(node, resolve=True), "plan")
    return train, plan


def resolve_for_plan(cfg, hc, plan: PlanConfig, output_dir: str):
    """The ``TrainConfig`` of the job planned, checked as a launch would check it (the
    model's layout: TP plan, pipeline split, context-parallel split), without reading data."""
    from automodel.checks.preflight import check_model_layout
    from automodel.config.resolve import resolve

    overrides = without_keys(list(hc.overrides.task), ("plan.",))
    env = planning_env(plan, cfg.mesh.dp_size, cfg.distributed.nproc_per_node)
    explicit = plan.gpus is not None and cfg.mesh.dp_size is not None
    if explicit:  # (the mesh's own ranks, then held against plan.gpus)
        env = planning_env(PlanConfig(gpus=None), cfg.mesh.dp_size)
    train = resolve(cfg, env=env, output_dir=output_dir, choices=dict(hc.runtime.choices),
                    overrides=overrides)
    if explicit and train.layout.world_size != plan.gpus:
        lay = train.layout
        raise ConfigError(
            f"plan.gpus={plan.gpus} but the mesh has {lay.world_size} ranks (one per GPU): "
            f"mesh.dp_size={cfg.mesh.dp_size} x tp_size={lay.tp} x cp_size={lay.cp} x "
            f"pp_size={lay.pp}; set plan.gpus={lay.world_size}, or mesh.dp_size=null (then "
            "inferred from plan.gpus)")
    check_model_layout(train)
    return train


def _run(cfg, hc, admission=None):
    from automodel.compat import check_planning_compat
    from automodel.costing.gpus import profile
    from automodel.planning.supported import check_plannable

    train_cfg, plan_cfg = split_plan_node(cfg)
    gpu = profile(plan_cfg.gpu, **plan_cfg.gpu_spec)
    if plan_cfg.calibrate_from is not None:
        gpu, plan_cfg = calibrated(plan_cfg, list(hc.overrides.task))
    start_simulation_server(train_cfg)
    out = hc.runtime.output_dir
    if plan_cfg.search:
        from automodel.planning.search import resolve_for_search, run_search

        train = resolve_for_search(without_keys(list(hc.overrides.task), ("plan.",)))
        check_planning_compat()
        check_plannable(train)  # (make_plan checks its own job)
        return run_search(train, gpu, plan_cfg, out, admission)
    train = resolve_for_plan(train_cfg, hc, plan_cfg, out)
    check_planning_compat()
    from automodel.planning.plan import make_plan

    result = make_plan(train, gpu, plan_cfg.calibration, plan_cfg.workers,
                       full_depth=plan_cfg.full_depth)
    write_plan(result, out, plan_cfg.picture)
    print(summary(result))
    return result


def calibrated(plan_cfg: PlanConfig, overrides: list[str]) -> tuple:
    """(the device profile, ``plan_cfg`` with the calibration) of ``plan.calibrate_from``: the
    run's device and its fitted efficiencies, under the keys of ``plan.calibration``."""
    import dataclasses

    from automodel.costing.calibrate import read_calibration
    from automodel.costing.gpus import GpuProfile

    device, fitted = read_calibration(plan_cfg.calibrate_from)
    named = [o for o in overrides if o.lstrip("+").startswith(("plan.gpu=", "plan.gpu_spec"))]
    if named and (plan_cfg.gpu != device["name"] or plan_cfg.gpu_spec):
        raise ConfigError(f"plan.calibrate_from={plan_cfg.calibrate_from} was measured on "
                          f"{device['name']} ranks, and {' '.join(named)} plans another "
                          "device: a calibration holds for the device it was measured on. "
                          "Drop it, or calibrate from a run on that device")
    calibration = {**fitted, **plan_cfg.calibration}
    log.info("plan.calibrate_from=%s: planning on its %s profile with %s", plan_cfg.calibrate_from,
             device["name"], ", ".join(f"{k}={v:.3g}" for k, v in calibration.items()
                                      if isinstance(v, float)))
    return GpuProfile(**device), dataclasses.replace(plan_cfg, calibration=calibration)


def write_plan(plan: dict, out: str, picture: bool = True) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "plan.json")
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    if picture:
        from automodel.planning.picture import draw_plan

        draw_plan(plan, os.path.join(out, "plan.png"))
    return path


def summary(plan: dict) -> str:
    """What the plan says, in a few lines (plan.json has the rest)."""
    gib = 2**30
    lay = plan["layout"]
    lines = [f"plan: {plan['model']['name']} ({plan['model']['parameters'] / 1e9:.2f}B "
             f"parameters) on {plan['world_size']} x {plan['gpu']['name']}: "
             + " x ".join(f"{k} {lay[k]}" for k in ("pp", "dp_replicate", "dp_shard", "cp",
                                                     "tp", "ep") if lay[k] > 1)]
    for r in plan["ranks"]:
        host = (f" (+ {r['host_bytes'] / gib:.2f} GiB offloaded to the host)"
                if r.get("host_bytes") else "")
        lines.append(f"  {r['name']} (x{r['count']}): peak {r['peak_bytes'] / gib:.2f} GiB "
                     f"+ {r['overhead_bytes'] / gib:.2f} GiB overhead{host}, "
                     f"{'fits' if r['fits'] else 'DOES NOT FIT'}; "
                     f"{r['flops'] / 1e12:.1f} TFLOP/step")
    t = plan["time"]
    lines.append(f"  step {plan['step_time_s']:.3f} s (compute {t['compute_s']:.3f}, exposed "
                 f"comm {t['exposed_comm_s']:.3f}, bubble {t['bubble_s']:.3f}); "
                 f"{plan['tokens_per_s']:.0f} tokens/s")
    lines += [f"  warning: {w}" for w in plan["warnings"]]
    lines += [f"  note: {n}" for n in plan.get("notes", [])]
    lines.append(f"  run it: {plan['command']}")
    return "\n".join(lines)


def load_plan(overrides: list[str], output_dir: str = "."):
    """(the job's ``TrainConfig``, the ``PlanConfig``) of ``python plan.py <overrides>``;
    raises ``ConfigError`` where plan.py would refuse. Nothing is simulated."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from automodel.config.cli_check import check_choice_overrides
    from automodel.config.compose import CONF_DIR
    from automodel.config.store import register_schemas

    register_schemas()
    check_choice_overrides(list(overrides))
    if GlobalHydra.instance().is_initialized():
        cfg = compose(config_name="plan", overrides=list(overrides), return_hydra_config=True)
    else:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="plan", overrides=list(overrides),
                          return_hydra_config=True)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    hc = SimpleNamespace(overrides=SimpleNamespace(task=list(overrides)),
                         runtime=SimpleNamespace(choices=choices))
    train_cfg, plan = split_plan_node(cfg)
    return resolve_for_plan(train_cfg, hc, plan, output_dir), plan
