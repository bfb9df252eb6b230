"""Weights & Biases tracking from rank 0.

One W&B run per job: the resolved config, ``hydra.runtime.choices`` (also as ``group:option``
tags) and the overrides as config; every metrics.jsonl record as history; runs of one sweep
grouped by the sweep's directory name. The run id is derived from the SLURM job (or the
output directory), so a requeued job resumes the same run.
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


class WandbTracker:
    def __init__(self, cfg: WandbConfig, output_dir: str, resolved: dict, choices: dict,
                 overrides: list, sweep_dir: str | None):
        import wandb

        directory = cfg.dir or os.environ.get("WANDB_DIR") or output_dir
        os.makedirs(directory, exist_ok=True)
        group = cfg.group or (os.path.basename(os.path.normpath(sweep_dir)) if sweep_dir else None)
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, mode=cfg.mode, group=group,
            job_type=cfg.job_type, name=cfg.name or os.path.basename(os.path.normpath(output_dir)),
            tags=run_tags(choices, cfg.tags), id=cfg.id or stable_run_id(output_dir),
            resume="allow", dir=directory, reinit="finish_previous",
            config={"config": resolved, "choices": choices, "overrides": overrides})

    def log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def finish(self) -> None:
        self.run.finish()
