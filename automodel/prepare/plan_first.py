"""A planned run: the job's plan made once, before any rank starts, for the ranks to compare
themselves with (``trainer.plan_check_steps``; ``tracking/plan_check.py`` measures).

- ``layout=auto``: the search's plan of the chosen layout is the run's (``auto_layout``);
  the check is on unless the user set ``trainer.plan_check_steps``
  (``auto_layout.auto_check_overrides``).
- A manual layout with ``trainer.plan_check_steps=N``: the launching process (``python
  train.py``'s local launch, or the SLURM submitter) plans the job on the device profile of
  the ranks it starts, and writes ``plan.json`` beside the run.
- Ranks an outer launcher started (torchrun, a plain srun) need a ``plan.json`` already in
  the run's folder: each would otherwise plan alone.
"""

from __future__ import annotations

import json
import logging
import os

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig

log = logging.getLogger("automodel")

def ensure_plan(cfg: TrainConfig) -> None:
    """Before the ranks of a manual layout with ``trainer.plan_check_steps`` start: plan the
    job here (a local launch), or check that its plan lies beside the run (ranks an outer
    launcher started)."""
    if not cfg.trainer.plan_check_steps:
        return
    if cfg.launch.external:
        if not _has_check(cfg.output_dir):
            raise ConfigError(
                f"trainer.plan_check_steps={cfg.trainer.plan_check_steps} under "
                f"{cfg.launch.kind}: the plan is made once, before the ranks start, and "
                f"{os.path.join(cfg.output_dir, 'plan.json')} holds none. Launch with python "
                "train.py (local ranks) or python train.py -m hydra/launcher=slurm, or set "
                "trainer.plan_check_steps=0")
        return
    from automodel.prepare.device_profiles import local_profile

    plan_job(cfg, local_profile(cfg))


def plan_at_submit(job: TrainConfig, nodes: int, tasks_per_node: int,
                   partition: str | None) -> list[str]:
    """A SLURM submitter's part, before it submits ``job``: ``layout=auto`` searched for its
    nodes (returns the chosen layout's overrides, ``layout=manual`` among them, for the tasks
    to compose), or a job that checks its plan planned on the nodes' profile (returns []);
    ``plan.json`` in the job's output directory either way."""
    if job.layout_mode == "auto":
        from automodel.prepare.auto_layout import slurm_layout

        return slurm_layout(job, nodes, tasks_per_node, job.output_dir, partition)
    if job.trainer.plan_check_steps:
        from automodel.prepare.device_profiles import slurm_profile

        plan_job(job, slurm_profile(partition, tasks_per_node))
    return []


def plan_job(cfg: TrainConfig, profile) -> dict:
    """``cfg``'s job planned on ``profile``; ``plan.json`` (with its check entry) written
    beside the run."""
    from automodel.costing.calibrate import check_entry
    from automodel.planning.plan import make_plan, spelled_overrides
    from automodel.planning.search import _resolve
    from automodel.planning.supported import check_plannable

    job = _resolve(spelled_overrides(cfg) + ["layout=manual"])
    try:
        check_plannable(job)
    except ConfigError as err:
        raise ConfigError(f"trainer.plan_check_steps={cfg.trainer.plan_check_steps}: this "
                          f"job cannot be planned: {err}\nSet trainer.plan_check_steps=0") \
            from None
    log.info("planning the job before it starts (trainer.plan_check_steps=%d) on %d %s rank%s",
             cfg.trainer.plan_check_steps, cfg.layout.world_size, profile.name,
             "s" if cfg.layout.world_size > 1 else "")
    plan = make_plan(job, profile)
    plan["check"] = check_entry(plan)
    os.makedirs(cfg.output_dir, exist_ok=True)
    path = os.path.join(cfg.output_dir, "plan.json")
    with open(path + ".tmp", "w") as f:
        json.dump(plan, f, indent=1)
    os.replace(path + ".tmp", path)
    log.info("planned: %.3g s/step, peak %.1f MiB per rank (%s)", plan["step_time_s"],
             max(r["peak_bytes"] for r in plan["ranks"]) / 2**20, path)
    return plan


def _has_check(output_dir: str) -> bool:
    path = os.path.join(output_dir, "plan.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return "check" in json.load(f)
