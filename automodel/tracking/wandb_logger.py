"""Weights & Biases tracking from rank 0.

One W&B run per job: the resolved config, ``hydra.runtime.choices`` (also as ``group:option``
tags) and the overrides as config; every metrics.jsonl record as history; runs of one sweep
grouped by the sweep's directory name. The run id is saved with every checkpoint, and a run
resumed from one continues that W&B run (a resubmission, ``checkpoint.resume=auto``); a run
that starts afresh derives its id from the SLURM job (or the output directory), so a requeued
job resumes the same run.
"""

from __future__ import annotations

import hashlib
import os

from automodel.config.schema import WandbConfig


def stable_run_id(output_dir: str, env=os.environ) -> str:
    if "SLURM_JOB_ID" in env:
        job = env.get("SLURM_ARRAY_JOB_ID", env["SLURM_JOB_ID"])
        task = env.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{job}" + (f"-{task}" if task is not None else "")
    return "run-" + hashlib.sha1(os.path.abspath(output_dir).encode()).hexdigest()[:16]


def run_tags(choices: dict, extra: list) -> list:
    tags = [f"{group}:{option}" for group, option in sorted(choices.items())
            if option is not None and not group.startswith("hydra") and
            not group.startswith("schema")]
    return tags + list(extra)


DEFAULT_PROJECT = "automodel"


def init_kwargs(cfg: WandbConfig, output_dir: str, resolved: dict, choices: dict,
                overrides: list, sweep_dir: str | None, env=os.environ,
                resumed_id: str | None = None, experiment: str | None = None) -> dict:
    """The keyword arguments of ``wandb.init`` for this job (pure: no wandb, no files).

    ``mode``, ``entity``, ``project`` and ``dir`` come from the config when it sets them, else
    from W&B's own variables (WANDB_MODE, WANDB_ENTITY, WANDB_PROJECT, WANDB_DIR) as they are
    now: wandb reads its environment once per process (``wandb.setup``) and ignores later
    changes, and one process may run several jobs (``parallelism=none``, sweeps, the API).
    With neither, ``mode`` and ``entity`` are left out (W&B's settings and defaults apply),
    the project is "automodel" and the run writes into the job's output directory.
    The run id: ``logger.wandb.id``, else that of the checkpoint resumed from
    (``resumed_id``), else derived from the job; the name: ``logger.wandb.name``, else the
    experiment, else the output directory's name.
    """
    kwargs = {}
    for key, var in (("mode", "WANDB_MODE"), ("entity", "WANDB_ENTITY")):
        value = getattr(cfg, key) or env.get(var)
        if value:
            kwargs[key] = str(value)  # (mode: a WandbMode member; wandb takes the string)
    kwargs["project"] = cfg.project or env.get("WANDB_PROJECT") or DEFAULT_PROJECT
    kwargs["dir"] = cfg.dir or env.get("WANDB_DIR") or output_dir
    group = cfg.group or (os.path.basename(os.path.normpath(sweep_dir)) if sweep_dir else None)
    kwargs.update(
        group=group, job_type=cfg.job_type,
        name=cfg.name or experiment or os.path.basename(os.path.normpath(output_dir)),
        tags=run_tags(choices, cfg.tags),
        id=cfg.id or resumed_id or stable_run_id(output_dir, env),
        resume="allow", reinit="finish_previous",
        config={"config": resolved, "choices": choices, "overrides": overrides})
    return kwargs


class WandbTracker:
    def __init__(self, cfg: WandbConfig, output_dir: str, resolved: dict, choices: dict,
                 overrides: list, sweep_dir: str | None, resumed_id: str | None = None,
                 experiment: str | None = None):
        import wandb

        kwargs = init_kwargs(cfg, output_dir, resolved, choices, overrides, sweep_dir,
                             resumed_id=resumed_id, experiment=experiment)
        os.makedirs(kwargs["dir"], exist_ok=True)
        self.run = wandb.init(**kwargs)

    def log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items()  # (no per-rank lists, no nulls)
                      if k != "step" and v is not None and not isinstance(v, list)},
                     step=record["step"])

    def finish(self) -> None:
        self.run.finish()
