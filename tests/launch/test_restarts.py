"""In-job restarts (``distributed.max_restarts``) under the local launcher: a rank that dies
stops every rank, and they start again inside the same job, resuming from the last complete
checkpoint. Real SIGKILLs of real rank processes (the fault drills, automodel/faults.py), whose
``/restart`` qualifier counts the in-job restarts."""

import re

import pytest

from automodel.api import run as api_run
from automodel.checkpoint.paths import checkpoint_path
from automodel.errors import LaunchError
from tests.helpers import BASE, ON_CPU, train

RUN = ["parallelism=ddp", "trainer.max_steps=6", "checkpoint.every_steps=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(the records of an uninterrupted run, its checkpoint directory)."""
    root = tmp_path_factory.mktemp("full")
    return train(RUN, root), root / "checkpoints"


def test_a_rank_killed_once_is_restarted_from_the_runs_newest_checkpoint(
        uninterrupted, tmp_path, monkeypatch):
    """A run started from another run's step-2 checkpoint (an explicit
    ``checkpoint.resume=<path>``) saves step 4 in its own directory; rank 1 is killed at the
    start of step 5 in the first attempt only (``/0``), one restart allowed: the ranks start
    again from the run's own step 4, not from the path it first started from, so steps 3-6
    each run once, with the uninterrupted run's losses and gradient norms."""
    full, checkpoints = uninterrupted
    monkeypatch.setenv("AUTOMODEL_FAULTS", "kill@5:1/0")
    first = checkpoint_path(str(checkpoints), 2)
    records = train(RUN + ["distributed.max_restarts=1", f"checkpoint.resume={first}"],
                    tmp_path)
    assert [r["step"] for r in records] == [5, 6]  # (rank 0's records of the last run)
    log = (tmp_path / "train.log").read_text()
    assert "in-job restart 1 of distributed.max_restarts=1" in log
    assert f"resuming from the run's newest checkpoint, {tmp_path}" in log
    from automodel.tracking.metrics import read_metrics

    written = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in written] == [3, 4, 5, 6]  # each step once
    assert [(r["loss"], r["grad_norm"]) for r in written] == \
        [(r["loss"], r["grad_norm"]) for r in full[2:]]


@pytest.mark.parametrize("restarts", [0, 2])
def test_a_rank_that_dies_in_every_attempt_ends_the_job_with_the_cause(restarts, tmp_path,
                                                                       monkeypatch):
    """``max_restarts=0``: the job fails at once, as without restarts; ``2``: the rank dies
    in each of the 3 attempts and the job then fails; either way naming the rank and how it
    died."""
    monkeypatch.setenv("AUTOMODEL_FAULTS", "kill@3:1")
    with pytest.raises(LaunchError) as err:
        api_run(ON_CPU + BASE + RUN + [f"distributed.max_restarts={restarts}"], str(tmp_path))
    assert re.search(r"rank 1 failed \(exit code -9\)", str(err.value)), str(err.value)
    log = (tmp_path / "train.log").read_text()
    assert log.count("in-job restart") == restarts


@pytest.mark.fast
@pytest.mark.parametrize("under_the_srun_function", [True, False])
def test_a_stopped_rank_under_the_srun_function_ignores_srun_s_sigterm(
        under_the_srun_function, monkeypatch):
    """After its stop, a rank under the srun function of in-job restarts ignores stop signals
    until it exits: srun terminates a step's other ranks once one has exited with its stop
    code (--kill-on-bad-exit), and a rank that SIGTERM killed would end with 143, which the
    function restarts as a failure. Elsewhere the handlers found at install come back."""
    import signal

    from automodel.runtime.attempts import ATTEMPT_ENV
    from automodel.runtime.signals import STOP_SIGNALS, StopSignal

    if under_the_srun_function:
        monkeypatch.setenv(ATTEMPT_ENV, "0")
    else:
        monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        for stopped in (False, True):
            stop = StopSignal().install()
            if stopped:
                stop._handle(signal.SIGUSR1, None)
            stop.restore()
            ignored = stopped and under_the_srun_function
            for sig in STOP_SIGNALS:
                assert signal.getsignal(sig) == (signal.SIG_IGN if ignored else before[sig])
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
