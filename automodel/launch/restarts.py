"""In-job restarts (``distributed.max_restarts``) where an outer launcher starts the ranks.

- Local launches: the local launcher's torch elastic agent (``launch/local.py``).
- torchrun: torchrun's own ``--max-restarts`` (it numbers its attempts the same way).
- SLURM: the batch script runs srun again. A shell function named ``srun`` (``srun_function``)
  wraps the real one: when a step fails it starts the step again, up to N times, inside the
  same allocation, and each new step resumes from the last complete checkpoint. The SLURM
  launchers (``hydra/launcher=slurm``, ``python -m launchers.slurm``) put it in their job
  script; a batch script defines it with ``eval "$(python -m automodel.launch.restarts)"``.

Why srun again, and not a torchrun agent per node under srun: every SLURM task stays one rank
(the same task layout, GPU binding and environment as a plain ``srun python train.py``), no
rendezvous server has to live on a node that may be the one lost, and a step that fails is
cleaned up by SLURM itself (``--kill-on-bad-exit``) before the next starts. A restart costs a
new Python start-up per rank, as torch elastic's restarts do.

A step is not started again when it ended with 0, with 2 (a configuration error: it would fail
the same way) or after a stop signal's save (a preemption, a time limit or a user's stop, which
requeue or end the job on their own). srun's exit code cannot tell that stop from a failure by
itself: a stopped rank exits with 128 + the signal, and so does a rank that SLURM terminates
because another died (srun reports the largest code of its tasks). Under the srun function a
stopped rank therefore exits with 64 + the signal (``task_exit_code``), which no failure
produces, and the function turns it back into 128 + the signal for the batch script. When the
restarts are spent, the step's exit code is the batch script's, and the job script's requeue
(``hydra.launcher.requeue``) comes after: requeue only once the in-job restarts are spent.
"""

from __future__ import annotations

from typing import Mapping

from automodel.runtime.attempts import ALLOWED_ENV, ATTEMPT_ENV, under_srun_function

CONFIG_ERROR_EXIT = 2


STOPPED_BASE = 64  # a rank stopped by a signal, under the srun function: 64 + the signal
STOPPED_VAR = "automodel_stopped"  # set by the srun function when its step was stopped


def stopped_exit_codes() -> list[int]:
    """The exit codes of ranks that a stop signal stopped after their save, under the srun
    function (SIGUSR1, SIGUSR2, SIGTERM: 74, 76, 79)."""
    from automodel.runtime.signals import STOP_SIGNALS

    return sorted(STOPPED_BASE + int(s) for s in STOP_SIGNALS)


def task_exit_code(stopped) -> int:
    """The exit code of a SLURM task that ``stopped`` (a ``TrainingStopped``) ends: 64 + the
    signal under the srun function, else the shell's 128 + the signal."""
    if under_srun_function():
        return STOPPED_BASE + stopped.signum
    return stopped.exit_code


def srun_function() -> str:
    """The bash function ``srun`` that starts a failed step again. The restarts allowed:
    ``$AUTOMODEL_MAX_RESTARTS``, else ``distributed.max_restarts=N`` among srun's arguments,
    else 0. Each step runs with ``--kill-on-bad-exit=1`` (a dead rank ends its step at once;
    an srun argument of the script's own comes after it and wins), and gets
    ``AUTOMODEL_MAX_RESTARTS`` and its attempt number
    ``AUTOMODEL_SRUN_ATTEMPT``; the ranks check the first against their config. A step that a
    stop signal ended sets ``$automodel_stopped`` (the job script's requeue reads it)."""
    stopped = "|".join(str(c) for c in stopped_exit_codes())
    return f"""srun() {{  # automodel: distributed.max_restarts inside the SLURM job
  local allowed=${{{ALLOWED_ENV}:-}} attempt=0 rc arg
  if [ -z "$allowed" ]; then
    allowed=0
    for arg in "$@"; do
      case "$arg" in distributed.max_restarts=*|+distributed.max_restarts=*|\\
        ++distributed.max_restarts=*) allowed=${{arg#*=}} ;; esac
    done
  fi
  while :; do
    {ALLOWED_ENV}=$allowed {ATTEMPT_ENV}=$attempt command srun --kill-on-bad-exit=1 "$@"
    rc=$?
    case "$rc" in
      0|{CONFIG_ERROR_EXIT}) return "$rc" ;;
      {stopped}) {STOPPED_VAR}=1; return $((rc + {128 - STOPPED_BASE})) ;;
    esac
    [ "$attempt" -ge "$allowed" ] && return "$rc"
    attempt=$((attempt + 1))
    echo "automodel: srun ended with exit code $rc; starting the job's ranks again (in-job" \\
      "restart $attempt of distributed.max_restarts=$allowed): they resume from the last" \\
      "complete checkpoint" >&2
  done
}}"""


def job_script_lines(restarts: list[int], requeue: bool = False) -> list[str]:
    """A submitit job script's setup lines for jobs allowing ``restarts`` (one entry per job of
    a sweep, in the order of its array tasks); none when no job restarts and none is requeued
    (a requeue needs the function too: it tells a stopped step from a failed one)."""
    if not any(restarts) and not requeue:
        return []
    if len(set(restarts)) <= 1:
        allowed = [f"export {ALLOWED_ENV}={int(restarts[0]) if restarts else 0}"]
    else:  # (a sweep over distributed.max_restarts: one array task per job)
        values = " ".join(str(int(r)) for r in restarts)
        allowed = [f"automodel_restarts=({values})",
                   f"export {ALLOWED_ENV}=${{automodel_restarts[${{SLURM_ARRAY_TASK_ID:-0}}]}}"]
    return allowed + srun_function().splitlines()


def check_outer_restarts(max_restarts: int, kind: str, env: Mapping[str, str]) -> str | None:
    """Why ``distributed.max_restarts`` cannot be honoured by the launcher that started this rank
    (``kind``: ``LaunchEnv.kind``), with the fix; None when it can."""
    if kind == "slurm":
        given = env.get(ALLOWED_ENV)
        if given is None and max_restarts == 0:
            return None
        if given is None:
            return (f"distributed.max_restarts={max_restarts} under srun, but nothing starts "
                    "this job's srun step again: in the batch script, run "
                    '`eval "$(python -m automodel.launch.restarts)"` before srun (it defines '
                    "an srun that restarts a failed step, docs/slurm.md), or submit with "
                    "hydra/launcher=slurm or python -m launchers.slurm, which do it")
        if int(given) != max_restarts:
            return (f"distributed.max_restarts={max_restarts}, but the srun around this task "
                    f"starts the step again {given} times ({ALLOWED_ENV}={given}): pass "
                    "distributed.max_restarts on the srun line itself, or export "
                    f"{ALLOWED_ENV}={max_restarts} in the batch script")
        return None
    if kind == "torchrun" and max_restarts > 0:
        given = env.get("TORCHELASTIC_MAX_RESTARTS")
        if given is None or int(given) != max_restarts:
            return (f"distributed.max_restarts={max_restarts} under torchrun, which restarts "
                    f"the ranks itself ({'no torch elastic agent' if given is None else given})"
                    f": pass --max-restarts={max_restarts} to torchrun")
    return None


if __name__ == "__main__":  # eval "$(python -m automodel.launch.restarts)" in a batch script
    print(srun_function())
