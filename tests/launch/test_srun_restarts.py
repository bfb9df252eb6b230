"""The srun function of in-job restarts under SLURM (``automodel.launch.restarts``), run by
real bash. srun here is a stand-in script on PATH that records what each step was given and
exits with the codes a test lists: a failed step on a real cluster ends the same way, and the
real thing runs in tests/launch/test_slurm_faults.py. Also the ranks' check of what the
launcher around them allows, and the job script's lines."""

import os
import signal
import subprocess
import sys

import pytest

from automodel.errors import TrainingStopped
from automodel.launch.restarts import (
    check_outer_restarts,
    job_script_lines,
    stopped_exit_codes,
    task_exit_code,
)
from automodel.launch.slurm import job_script_parameters, next_run, requeue_parameters
from automodel.runtime.attempts import ALLOWED_ENV, ATTEMPT_ENV, in_job_restart, restart_follows
from tests.cli.test_cli import ROOT

pytestmark = pytest.mark.fast

FAKE_SRUN = """#!/bin/bash
echo "attempt=${AUTOMODEL_SRUN_ATTEMPT} allowed=${AUTOMODEL_MAX_RESTARTS} args=$*" >> "$CALLS"
n=$(wc -l < "$CALLS")
code=$(sed -n "${n}p" "$CODES")
exit "${code:-0}"
"""


def _run(tmp_path, script: str, codes: list[int], env_extra=None):
    """Run ``script`` (bash) with the fake srun first on PATH answering ``codes`` in turn;
    returns (exit code, the recorded calls, stderr)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    (tmp_path / "codes").write_text("".join(f"{c}\n" for c in codes))
    calls = tmp_path / "calls"
    calls.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in (ALLOWED_ENV, ATTEMPT_ENV)}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", CALLS=str(calls), CODES=str(tmp_path / "codes"),
               PYTHONPATH=str(ROOT), **(env_extra or {}))
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         cwd=ROOT)
    return out.returncode, calls.read_text().splitlines(), out.stderr


DEFINE = f'eval "$({sys.executable} -m automodel.launch.restarts)"\n'


def test_a_failed_step_is_started_again_until_it_passes_or_the_restarts_are_spent(tmp_path):
    rc, calls, err = _run(tmp_path, DEFINE + "srun python train.py distributed.max_restarts=2",
                          [1, 137, 0])
    assert rc == 0
    assert [c.split(" args=")[0] for c in calls] == [
        "attempt=0 allowed=2", "attempt=1 allowed=2", "attempt=2 allowed=2"]
    # (a dead rank ends the step at once: SLURM kills the others)
    assert all(c.endswith("args=--kill-on-bad-exit=1 python train.py "
                          "distributed.max_restarts=2") for c in calls)
    assert "srun ended with exit code 137; starting the job's ranks again (in-job restart 2 " \
           "of distributed.max_restarts=2)" in err
    rc, calls, err = _run(tmp_path, DEFINE + "srun -n 2 python train.py "
                          "++distributed.max_restarts=1", [1, 9, 0])
    assert (rc, len(calls)) == (9, 2)  # one restart, then the second failure is the script's
    assert err.count("starting the job's ranks again") == 1


@pytest.mark.parametrize("code,final", [(2, 2), (74, 138), (76, 140), (79, 143)])
def test_a_configuration_error_or_a_stop_signals_save_is_never_restarted(tmp_path, code, final):
    """Exit code 2, or ranks stopped after their save (64 + SIGUSR1, SIGUSR2, SIGTERM): the
    step ends the srun function, with the shell's code for the signal (128 + it). 143 is a
    rank that SLURM terminated after another died: restarted."""
    assert stopped_exit_codes() == [74, 76, 79]
    rc, calls, _ = _run(tmp_path, DEFINE + "srun python train.py distributed.max_restarts=3",
                        [code, 0])
    assert (rc, len(calls)) == (final, 1)
    rc, calls, _ = _run(tmp_path, DEFINE + "srun python train.py distributed.max_restarts=3",
                        [143, 0])
    assert (rc, len(calls)) == (0, 2)


def test_the_restarts_come_from_the_environment_first_then_the_srun_line(tmp_path):
    rc, calls, _ = _run(tmp_path, DEFINE + "srun python train.py distributed.max_restarts=5",
                        [1, 1, 1], env_extra={ALLOWED_ENV: "1"})
    assert (rc, len(calls)) == (1, 2)
    rc, calls, _ = _run(tmp_path, DEFINE + "srun python train.py", [1, 0])  # none allowed
    assert (rc, calls) == (1, ["attempt=0 allowed=0 args=--kill-on-bad-exit=1 python train.py"])


def test_the_job_script_lines_give_each_sweep_job_its_own_restarts(tmp_path):
    assert job_script_lines([0, 0]) == []
    assert job_script_lines([0], requeue=True)[0] == f"export {ALLOWED_ENV}=0"
    assert job_script_lines([2])[0] == f"export {ALLOWED_ENV}=2"
    lines = job_script_lines([1, 0, 3])  # (one array task per job of the sweep)
    for task, allowed in ((None, 1), ("1", 0), ("2", 3)):
        env = {} if task is None else {"SLURM_ARRAY_TASK_ID": task}
        rc, calls, _ = _run(tmp_path, "\n".join(lines) + "\nsrun python train.py",
                            [1] * 5, env_extra=env)
        assert (rc, len(calls)) == (1, allowed + 1)
        assert calls[0].startswith(f"attempt=0 allowed={allowed} ")
    # with a requeue: the function's lines after the requeue's, the teardown unchanged
    params = job_script_parameters(1, [2])
    assert params["setup"][:2] == ["export AUTOMODEL_REQUEUE=1", f"export {ALLOWED_ENV}=2"]
    assert params["teardown"] == requeue_parameters(1)["teardown"]
    assert job_script_parameters(0, [0]) == {}  # (a job script as submitit writes it)


def test_the_requeue_follows_the_restarts_and_never_a_configuration_error(tmp_path):
    """The job script's teardown (its scontrol a stand-in that records the requeue) after the
    srun function: a failure requeues once the restarts are spent; exit code 2 does not, nor
    ranks stopped by a signal after their save (a time limit's USR2 without submitit's requeue:
    74-79), while 143 from ranks SLURM terminated does. Without in-job restarts too."""
    for restarts, codes, requeued in ((1, [1, 1], True), (1, [2], False), (1, [1, 0], False),
                                      (0, [76], False), (0, [143], True), (1, [1, 79], False)):
        params = job_script_parameters(1, [restarts])
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$*" >> "$CALLS.scontrol"\n'
                                          '[ "$1" = -o ] && echo "JobState=RUNNING"\nexit 0\n')
        (bin_dir / "scontrol").chmod(0o755)
        script = "\n".join(params["setup"] + ["srun python train.py"] + params["teardown"])
        (tmp_path / "calls.scontrol").write_text("")
        rc, calls, _ = _run(tmp_path, script, codes, env_extra={"SLURM_JOB_ID": "7"})
        assert len(calls) == len(codes)
        assert rc == (codes[-1] + 64 if codes[-1] in stopped_exit_codes() else codes[-1])
        assert ("requeue 7" in (tmp_path / "calls.scontrol").read_text()) == requeued


def test_a_rank_refuses_restarts_that_its_launcher_does_not_make():
    assert check_outer_restarts(0, "slurm", {}) is None
    assert check_outer_restarts(2, "slurm", {ALLOWED_ENV: "2"}) is None
    why = check_outer_restarts(2, "slurm", {})
    assert 'eval "$(python -m automodel.launch.restarts)"' in why
    assert "distributed.max_restarts=2 under srun" in why
    why = check_outer_restarts(0, "slurm", {ALLOWED_ENV: "3"})
    assert f"{ALLOWED_ENV}=3" in why and "distributed.max_restarts=0" in why
    assert check_outer_restarts(0, "torchrun", {}) is None
    assert check_outer_restarts(1, "torchrun", {"TORCHELASTIC_MAX_RESTARTS": "1"}) is None
    assert "--max-restarts=2" in check_outer_restarts(2, "torchrun",
                                                      {"TORCHELASTIC_MAX_RESTARTS": "0"})


def test_a_task_knows_what_follows_its_failure(monkeypatch):
    for name in (ALLOWED_ENV, ATTEMPT_ENV, "AUTOMODEL_REQUEUE", "SLURM_RESTART_COUNT",
                 "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert next_run() is None and not restart_follows() and in_job_restart() == 0
    monkeypatch.setenv(ALLOWED_ENV, "2")
    monkeypatch.setenv(ATTEMPT_ENV, "1")
    assert in_job_restart() == 1
    assert next_run().startswith("the job's ranks are started again (in-job restart 2 of 2)")
    monkeypatch.setenv(ATTEMPT_ENV, "2")  # the restarts spent: the requeue, if any, is next
    assert next_run() is None
    monkeypatch.setenv("AUTOMODEL_REQUEUE", "1")
    assert next_run().startswith("the job is requeued")
    stopped = TrainingStopped(signal.SIGUSR1, 4, None)
    assert task_exit_code(stopped) == 74  # (under the srun function)
    monkeypatch.delenv(ATTEMPT_ENV)
    assert task_exit_code(stopped) == 138 == stopped.exit_code
