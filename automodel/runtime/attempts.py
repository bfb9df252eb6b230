"""Which start of its job a rank is: torch elastic's restart count, or the count of the srun
function that starts a failed SLURM step again (``automodel/launch/restarts.py`` writes it).
Read by the rank itself (its restore, its faults), so it lives below the training code."""

from __future__ import annotations

import os
from typing import Mapping

ALLOWED_ENV = "AUTOMODEL_MAX_RESTARTS"  # the restarts the srun function allows
ATTEMPT_ENV = "AUTOMODEL_SRUN_ATTEMPT"  # 0 for the step's first run, then 1, 2, ...


def in_job_restart(env: Mapping[str, str] = os.environ) -> int:
    """How often this job's ranks were started again inside the job: torch elastic's attempt
    (the local launcher, torchrun) or the srun function's."""
    return int(env.get("TORCHELASTIC_RESTART_COUNT") or 0) + int(env.get(ATTEMPT_ENV) or 0)


def under_srun_function(env: Mapping[str, str] = os.environ) -> bool:
    """True in a SLURM task that the srun function of in-job restarts started: a stopped rank
    exits with 64 + the signal there (``launch/restarts.task_exit_code``) and ignores further
    stop signals until it does (``runtime/signals.StopSignal.restore``)."""
    return ATTEMPT_ENV in env


def restart_follows(env: Mapping[str, str] = os.environ) -> bool:
    """True in a SLURM task whose step the srun function will start again if it fails now."""
    return int(env.get(ATTEMPT_ENV) or 0) < int(env.get(ALLOWED_ENV) or 0)
