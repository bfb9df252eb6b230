"""``hydra/launcher=slurm``'s own part at submit time: the request checked against the
partition, and the stock submitit launcher's parameters (the job script's restart and requeue
lines). Each job of the sweep is checked and planned before any is queued by
``automodel/prepare/sweep_jobs.py``; the launcher plugin (``hydra_plugins/automodel_launcher``)
calls both.
"""

from __future__ import annotations

import sys
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
