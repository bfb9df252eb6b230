"""``hydra/launcher=slurm`` at submit time: each job of the sweep is preflighted before any is
queued.

Hydra calls the launcher's ``launch`` (``hydra_plugins/automodel_launcher``) in the submitting
process with every job of the sweep. Each job's config is composed as its SLURM tasks will
compose it, resolved against the world the job will have (``nodes`` x ``tasks_per_node``),
searched (``layout=auto``) or planned (``trainer.plan_check_steps``) for those nodes, and put
through ``automodel.checks.preflight.preflight``; one that fails stops the whole sweep, with
exit code 2, before any job is queued. The tasks run the preflight again (``automodel/cli.py``),
on the machine they run on.
"""

from __future__ import annotations

import sys
from pathlib import Path


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
    overrides of the layout the search chose (``automodel.prepare.auto_layout``), else []."""
    from omegaconf import open_dict

    from automodel.checks.preflight import preflight
    from automodel.config.compose import resolve_hydra_job
    from automodel.launch.slurm import submit_env
    from automodel.prepare.plan_first import plan_at_submit

    cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(cfg.hydra.job):
        cfg.hydra.job.num = idx
    hc = cfg.hydra
    output_dir = str(Path(str(hc.sweep.dir)) / _job_subdir(cfg))
    env = submit_env(launcher.params["nodes"], launcher.params["tasks_per_node"])
    job = resolve_hydra_job(cfg, hc, output_dir, multirun=True, env=env)

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
