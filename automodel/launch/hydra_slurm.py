"""``hydra/launcher=slurm`` at submit time: each job of the sweep is preflighted before any is
queued.

Hydra calls the launcher's ``launch`` (``hydra_plugins/automodel_launcher``) in the submitting
process with every job of the sweep. Each job's config is composed as its SLURM tasks will
compose it, resolved against the world the job will have (``nodes`` x ``tasks_per_node``) and
put through ``automodel.launch.preflight.preflight``; one that fails stops the whole sweep,
with exit code 2, before any job is queued. The tasks run the preflight again
(``automodel/cli.py``), on the machine they run on.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence


def check_slurm_request(params: dict) -> None:
    """Exit 2, before anything is submitted, when the jobs' request can never start on their
    partition (``automodel.launch.slurm_request``)."""
    from automodel.launch.slurm_request import Request, check_request

    keys = {k: f"hydra.launcher.{k}" for k in ("nodes", "tasks_per_node", "cpus_per_task")}
    problem = check_request(Request(
        int(params.get("nodes") or 1), int(params.get("tasks_per_node") or 1),
        int(params.get("cpus_per_task") or 1), params.get("timeout_min"),
        params.get("partition"), {**keys, "minutes": "hydra.launcher.timeout_min"}))
    if problem is not None:
        print(f"automodel: configuration error:\n{problem}; nothing was submitted",
              file=sys.stderr, flush=True)
        sys.exit(2)


def preflight_sweep(launcher, job_overrides: list, initial_job_idx: int) -> list[int]:
    """Preflight every job ``launcher`` (a submitit ``SlurmLauncher``, set up by Hydra) is
    about to submit; exit 2 with the first refusal. Returns each job's
    ``distributed.max_restarts``; a ``layout=auto`` job's overrides in ``job_overrides`` get
    the chosen layout's."""
    from automodel.config.build import ConfigError

    restarts = []
    for n, (idx, overrides) in enumerate(enumerate(job_overrides, start=initial_job_idx)):
        try:
            job_restarts, chosen = preflight_job(launcher, list(overrides), idx)
            restarts.append(job_restarts)
            if chosen:  # (layout=auto: the job's tasks compose the chosen layout)
                job_overrides[n] = with_overrides(list(overrides), chosen)
        except ConfigError as err:
            print(f"automodel: configuration error:\nsweep job #{idx} ({' '.join(overrides)}), "
                  f"refused before anything was submitted:\n{err}", file=sys.stderr, flush=True)
            sys.exit(2)
    return restarts


def preflight_job(launcher, overrides: list, idx: int) -> tuple[int, list[str]]:
    """Resolve job ``idx`` of the sweep as its tasks will, and preflight it; raises
    ``ConfigError``. Returns its ``distributed.max_restarts`` and, for ``layout=auto``, the
    overrides of the layout the search chose (``automodel.launch.auto_layout``), else []."""
    from omegaconf import open_dict

    from automodel.cli import resolve_hydra_job
    from automodel.launch.preflight import preflight
    from automodel.launch.slurm import submit_env

    cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(cfg.hydra.job):
        cfg.hydra.job.num = idx
    hc = cfg.hydra
    output_dir = str(Path(str(hc.sweep.dir)) / _job_subdir(cfg))
    env = submit_env(launcher.params["nodes"], launcher.params["tasks_per_node"])
    job = resolve_hydra_job(cfg, hc, output_dir, multirun=True, env=env)
    from automodel.launch.plan_first import plan_at_submit

    p = launcher.params
    chosen = plan_at_submit(job, p["nodes"], p["tasks_per_node"], p.get("partition"))
    if chosen:  # (layout=auto: the job as its tasks will compose it)
        cfg = launcher.hydra_context.config_loader.load_sweep_config(
            launcher.config, with_overrides(overrides, chosen))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = idx
        job = resolve_hydra_job(cfg, cfg.hydra, output_dir, multirun=True, env=env)
    preflight(job, gpus=job_gpus(launcher.params))
    return job.distributed.max_restarts, chosen


def with_overrides(overrides: list[str], replacing: list[str]) -> list[str]:
    """``overrides`` with those of the keys ``replacing`` sets dropped, then ``replacing``
    (Hydra refuses two values of one key in a job's overrides)."""
    keys = {o.lstrip("+").split("=", 1)[0] for o in replacing}
    return [o for o in overrides if o.lstrip("+").split("=", 1)[0] not in keys] + replacing


def _job_subdir(cfg) -> str:
    """``hydra.sweep.subdir`` of this job (its ``${hydra:...}`` interpolations read Hydra's
    global config, set for a job only once it runs)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_config = HydraConfig.instance()
    before = hydra_config.cfg
    hydra_config.set_config(cfg)
    try:
        return str(cfg.hydra.sweep.subdir)
    finally:
        hydra_config.cfg = before


def job_gpus(params: dict):
    """The GPUs each rank of the job will see, from what it asks SLURM for; None (unknown:
    the tasks check) when it asks in another way (``gres``, ``additional_parameters``) or not
    at all."""
    if params.get("gpus_per_node") is not None:
        return params["gpus_per_node"]
    return params.get("gpus_per_task")


def stock_parameters(params: dict, restarts: Sequence[int] = ()) -> dict:
    """The stock submitit launcher's parameters for automodel's (``hydra/launcher=slurm``):
    ``requeue`` and the jobs' ``distributed.max_restarts`` (``restarts``, one per job) become
    the job script's lines and sbatch's flag
    (``automodel.launch.slurm.job_script_parameters``), after the user's own setup lines."""
    from automodel.launch.slurm import job_script_parameters

    stock = {k: v for k, v in params.items() if k != "requeue"}
    extra = job_script_parameters(int(params.get("requeue") or 0), list(restarts))
    stock["setup"] = list(stock.get("setup") or []) + extra.get("setup", [])
    if "teardown" in extra:
        stock["teardown"] = extra["teardown"]
    stock["additional_parameters"] = {**(stock.get("additional_parameters") or {}),
                                      **extra.get("additional_parameters", {})}
    return stock
