"""Ranks started by SLURM: each srun task is one rank.

Under srun (a submitit job, or several tasks) torchrun is never used: rank, world size,
local rank and the rendezvous address come from SLURM's environment through
``submitit.helpers.TorchDistributedEnvironment``, so the same job scales to more nodes by
asking SLURM for more.
"""

from __future__ import annotations

import logging
import os


def submit_env(nodes: int, tasks_per_node: int) -> dict:
    """The environment a SLURM job's config is resolved in at submit time, before the job
    exists: the world it will have (nodes x tasks per node), seen from its rank 0."""
    return {"RANK": "0", "WORLD_SIZE": str(nodes * tasks_per_node),
            "LOCAL_WORLD_SIZE": str(tasks_per_node), "MASTER_ADDR": "submit-time-check"}


def export_rank_environment() -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from SLURM's variables."""
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def quiet_non_zero_rank(rank: int) -> None:
    """Only rank 0 writes the job's log file: other tasks drop the file handlers Hydra gave
    them (they still print errors)."""
    if rank == 0:
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()
    root.setLevel(logging.ERROR)


def task_log_path() -> str:
    """This SLURM task's log file (submitit's stderr), or the job id when unknown."""
    try:
        import submitit

        return str(submitit.JobEnvironment().paths.stderr)
    except Exception:  # not a submitit job
        return f"the log of SLURM job {os.environ.get('SLURM_JOB_ID', '?')}"
