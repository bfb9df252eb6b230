"""Ranks started by SLURM: each srun task is one rank; and the SLURM job around them (its
requeue after a failure, the submitter's wait for it).

Under srun (a plain ``srun python train.py`` in a batch script, or a submitit job) torchrun is
never used: rank, world size, local rank and the rendezvous address and port come from SLURM's
own variables (``automodel/config/slurm_env.py``), so the same job scales to more nodes by
asking SLURM for more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

log = logging.getLogger(__name__)


def submit_env(nodes: int, tasks_per_node: int) -> dict:
    """The environment a SLURM job's config is resolved in at submit time, before the job
    exists: the world it will have (nodes x tasks per node), seen from its rank 0."""
    return {"RANK": "0", "WORLD_SIZE": str(nodes * tasks_per_node),
            "LOCAL_WORLD_SIZE": str(tasks_per_node), "MASTER_ADDR": "submit-time-check"}


def export_rank_environment() -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from
    SLURM's variables (MASTER_ADDR and MASTER_PORT already set are kept)."""
    from automodel.config.slurm_env import rank_environment

    os.environ.update(rank_environment(os.environ))


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
    except Exception:  # not a submitit job: a plain srun in a batch script
        job = os.environ.get("SLURM_JOB_ID", "?")
        return f"the output of SLURM job {job} (sbatch --output; by default slurm-{job}.out)"


REQUEUE_ENV = "AUTOMODEL_REQUEUE"  # the job's requeues after a failure (its tasks read it)


def requeue_parameters(times: int) -> dict:
    """submitit's ``setup``, ``teardown`` and ``additional_parameters`` of a job that SLURM runs
    again, up to ``times`` times, when it fails: a rank or node lost, a step that raised. The
    teardown runs after srun only when srun ended by itself (a cancelled or preempted job never
    reaches it): srun failed and the job has been requeued fewer than ``times`` times, so it
    requeues the job, which resumes from its last complete checkpoint (never after exit code 2,
    a configuration error, nor after a stop signal's save, which the srun function of
    ``automodel.launch.restarts`` reports; with ``distributed.max_restarts``, only after that
    function's in-job restarts are spent). ``--requeue`` also lets SLURM
    requeue the job itself when it declares a node failed. The job's exit code stays srun's."""
    from automodel.launch.restarts import STOPPED_VAR

    if times <= 0:
        return {}
    requeue = (
        'if [ "$automodel_rc" -ne 0 ] && [ "$automodel_rc" -ne 2 ]'
        f' && [ -z "${STOPPED_VAR}" ]'
        ' && [ "${SLURM_RESTART_COUNT:-0}" -lt "$AUTOMODEL_REQUEUE" ]'
        ' && scontrol -o show job "$SLURM_JOB_ID" | grep -q "JobState=RUNNING"; then'
        ' echo "automodel: srun ended with exit code $automodel_rc; requeueing SLURM job'
        ' $SLURM_JOB_ID (requeue $((${SLURM_RESTART_COUNT:-0} + 1)) of $AUTOMODEL_REQUEUE):'
        ' it resumes from its last complete checkpoint" >&2;'
        ' scontrol requeue "$SLURM_JOB_ID"; fi')
    return {"setup": [f"export {REQUEUE_ENV}={int(times)}"],
            "teardown": ["automodel_rc=$?", requeue, 'exit "$automodel_rc"'],
            "additional_parameters": {"requeue": True}}


def job_script_parameters(requeue: int, restarts: list[int]) -> dict:
    """submitit's ``setup``, ``teardown`` and ``additional_parameters`` for a job (or each job of
    a sweep: ``restarts`` holds each one's ``distributed.max_restarts``): the srun function of
    the in-job restarts (``automodel.launch.restarts``), then ``requeue_parameters``."""
    from automodel.launch.restarts import job_script_lines

    params = requeue_parameters(requeue)
    lines = job_script_lines(restarts, requeue > 0)
    if lines:
        params["setup"] = params.get("setup", []) + lines
    return params


def requeue_follows() -> bool:
    """True in a task of a job that the teardown of ``requeue_parameters`` will requeue if it
    fails now (fewer requeues so far than allowed)."""
    allowed = int(os.environ.get(REQUEUE_ENV, 0) or 0)
    return int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0) < allowed


def next_run() -> str | None:
    """What follows if this task's job step fails now: an in-job restart by the srun function
    (``automodel.launch.restarts``), else a requeue; None when the job then ends."""
    from automodel.runtime.attempts import ALLOWED_ENV, ATTEMPT_ENV, restart_follows

    if restart_follows():
        attempt = int(os.environ.get(ATTEMPT_ENV) or 0) + 1
        return (f"the job's ranks are started again (in-job restart {attempt} of "
                f"{os.environ.get(ALLOWED_ENV)}) and resume from the last complete checkpoint")
    if requeue_follows():
        return "the job is requeued and resumes from its last complete checkpoint"
    return None


# SLURM's final states of a job that did not complete: a task killed in one of them writes no
# result file, so waiting for one is waiting for nothing
FAILED_STATES = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                 "DEADLINE", "PREEMPTED")
FAILED_RESULT_WAIT_S = 2.0  # (a result written just before the task died may still show up)


class _ResultWait:
    """submitit's ``Job._results_timeout_s`` (15 s: how long a finished job's result file may
    take to show on a slow shared file system), per job: ``FAILED_RESULT_WAIT_S`` for a job
    SLURM already reports failed, so its failure is reported at once."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __get__(self, job, owner=None) -> float:
        if job is None:
            return self.seconds
        state = job.watcher.get_state(job.job_id, mode="cache")
        return FAILED_RESULT_WAIT_S if state.split()[0] in FAILED_STATES else self.seconds


@contextlib.contextmanager
def job_states_refreshed(every_s: float = 10.0):
    """While the block waits on submitit jobs, ask SLURM for their states every ``every_s``
    seconds (one ``sacct`` for all of them). submitit's own checks back off to half the time
    since the last submission, up to 10 minutes, so a job that failed after an hour was seen
    up to 10 minutes late (a job that succeeds is seen at once: its result files). A job that
    failed is reported without submitit's 15 s wait for its result files (``_ResultWait``).
    A job that SLURM holds for a reason that never passes (``slurm_request.NEVER_REASONS``)
    is named, with the reason, and cancelled."""
    from submitit.slurm.slurm import SlurmJob

    from automodel.launch.slurm_request import cancel_jobs_that_never_start

    done, reported = threading.Event(), set()

    def refresh():
        first = True  # (at once, then every every_s: a job that can never start is named
        while first or not done.wait(every_s):  # within seconds of its submission)
            first = False
            try:
                watcher = SlurmJob.watcher
                watcher.update()
                cancel_jobs_that_never_start(
                    sorted(watcher._registered - watcher._finished), reported)
            except Exception as err:  # (the next wait, or submitit's own check, tries again)
                log.debug("refreshing the SLURM job states failed: %s", err)

    own = "_results_timeout_s" in SlurmJob.__dict__
    wait = SlurmJob._results_timeout_s
    SlurmJob._results_timeout_s = _ResultWait(wait if isinstance(wait, (int, float)) else 15)
    thread = threading.Thread(target=refresh, name="slurm-job-states", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if own:
            SlurmJob._results_timeout_s = wait
        else:
            del SlurmJob._results_timeout_s
