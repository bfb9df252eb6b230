"""Glue between ``train.py`` (Hydra) and automodel. No torch at import time."""

from __future__ import annotations

import os
import sys

from automodel.config.build import ConfigError
from automodel.config.launch_env import detect_launch_env
from automodel.errors import CheckpointError, LaunchError, TrainingStopped


def _fail(kind: str, message: str, code: int):
    print(f"automodel: {kind}:\n{message}", file=sys.stderr, flush=True)
    sys.exit(code)


def prepare_argv() -> None:
    """Adjust ``sys.argv`` before Hydra parses it.

    - Under torchrun every rank runs train.py and composes its own config; only rank 0 keeps
      a Hydra output directory and log file (the others learn rank 0's directory later).
    - Unknown keys get a message listing what is allowed.
    """
    launch = detect_launch_env(os.environ)
    if launch.external and launch.rank != 0:
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.",
                     "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    from automodel.config.cli_check import check_cli_overrides

    try:
        check_cli_overrides(sys.argv[1:])
    except ConfigError as err:
        _fail("configuration error", str(err), 2)


class SweepJobFailed(RuntimeError):
    """One job of a Hydra multirun failed; the sweep goes on and exits non-zero at the end."""


def run_from_hydra(cfg):
    """The Hydra task: validate, then run the job on one or more ranks.

    In a single run a failure exits (2: configuration, 1: a rank failed). In a local multirun
    it is reported with the job's number and overrides and raised, so Hydra runs the remaining
    jobs and then exits non-zero. A stop signal (SIGTERM, SIGUSR1/2) saves a checkpoint and
    exits with 128 + the signal's number. In a SLURM task (one rank of a submitit job) any failure
    exits the task non-zero, so SLURM and submitit see the job as failed and name its log.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    slurm_task = detect_launch_env(os.environ).kind == "slurm"
    try:
        return _run_job(cfg, hc)
    except TrainingStopped as stopped:  # saved and stopped on request: no traceback, and a
        # whole sweep stops too; the exit code is the shell's for that signal (143: SIGTERM)
        from automodel.launch.restarts import task_exit_code

        print(f"automodel: {stopped}", file=sys.stderr, flush=True)
        sys.exit(task_exit_code(stopped))
    except (ConfigError, LaunchError, CheckpointError) as err:
        kind, code = (("configuration error", 2) if isinstance(err, ConfigError)
                      else ("job failed", 1))
        if slurm_task:
            _fail(kind, f"{err}\n{_slurm_log(code != 2)}", code)
        if hc.mode != RunMode.MULTIRUN:
            _fail(kind, str(err), code)
        name = f"#{hc.job.num} ({' '.join(hc.overrides.task)})"
        print(f"automodel: sweep job {name} failed ({kind}):\n{err}\nlog: "
              f"{hc.runtime.output_dir}", file=sys.stderr, flush=True)
        raise SweepJobFailed(f"sweep job {name}: {kind}: {err} (log: "
                             f"{hc.runtime.output_dir})") from None
    except Exception as err:
        if not slurm_task:
            raise
        _fail("job failed", f"rank {os.environ.get('SLURM_PROCID', '?')}: "
              f"{type(err).__name__}: {err}\n{_slurm_log()}", 1)


def _slurm_log(can_follow: bool = True) -> str:
    """The task's log, and what follows its failure (``can_follow``: a run after this one could
    end otherwise; not after a configuration error)."""
    from automodel.launch.slurm import next_run, task_log_path

    then = next_run() if can_follow else None
    return f"log: {task_log_path()}" + (f"\n{then}" if then else "")


def _auto_layout(train_cfg, hc):
    """``layout=auto``: the job on the layout the search chose, its config written as the
    run's own (``.hydra/config.yaml``, ``overrides.yaml``: a rerun without the search is the
    same job)."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from automodel.config.compose import compose, named_by_time
    from automodel.prepare.auto_layout import choose_layout

    def compose_and_resolve(overrides: list[str]):
        from automodel.config.resolve import resolve

        composed, multirun = compose(overrides), hc.mode == RunMode.MULTIRUN
        job = resolve(composed, output_dir=hc.runtime.output_dir,
                      choices=dict(composed.hydra.runtime.choices), overrides=list(overrides),
                      sweep_dir=str(hc.sweep.dir) if multirun else None,
                      output_named_by_time=named_by_time(hc, multirun))
        saved = os.path.join(hc.runtime.output_dir, str(hc.output_subdir or ""))
        if hc.output_subdir is not None and os.path.isdir(saved):
            with open(os.path.join(saved, "config.yaml"), "w") as f:
                f.write(OmegaConf.to_yaml({k: composed[k] for k in composed if k != "hydra"}))
            with open(os.path.join(saved, "overrides.yaml"), "w") as f:
                f.write(OmegaConf.to_yaml(list(overrides)))
        return job

    return choose_layout(train_cfg, compose_and_resolve)


def _run_job(cfg, hc):
    from hydra.types import RunMode

    from automodel.config.compose import resolve_hydra_job
    from automodel.startup import without_collections

    with without_collections():  # (start-up: the imports of torch and transformers)
        train_cfg = resolve_hydra_job(cfg, hc, hc.runtime.output_dir,
                                      hc.mode == RunMode.MULTIRUN)
        if train_cfg.layout_mode == "auto":  # (the search, before any rank starts)
            train_cfg = _auto_layout(train_cfg, hc)
        else:  # (trainer.plan_check_steps: the plan, before any rank starts)
            from automodel.prepare.plan_first import ensure_plan

            ensure_plan(train_cfg)
        from automodel.checks.preflight import preflight  # (its checks import torch)

        preflight(train_cfg)
        if train_cfg.launch.kind == "slurm":
            from automodel.launch.slurm import quiet_non_zero_rank

            quiet_non_zero_rank(train_cfg.launch.rank)
        from automodel.launch.local import launch, runs_here  # torch from here on

        if runs_here(train_cfg):  # this process is the rank: its training code too
            import automodel.recipes.train  # noqa: F401
    records = launch(train_cfg)
    return records[-1]["loss"] if records else None
