"""``requeue`` (``hydra.launcher.requeue``, ``python -m launchers.slurm --requeue``): what the job
script and its tasks are given. The requeues themselves run on the local SLURM cluster
(tests/launch/test_slurm_nodes.py, tests/launch/test_slurm_faults.py)."""

import pytest

from automodel.faults import Faults, parse
from automodel.launch.hydra_slurm import stock_parameters
from automodel.launch.slurm import requeue_follows, requeue_parameters

pytestmark = pytest.mark.fast


def test_requeue_adds_the_job_script_lines_after_the_users_and_sbatch_requeue():
    params = {"nodes": 2, "requeue": 2, "setup": ["export SLURM_KILL_BAD_EXIT=1"],
              "additional_parameters": {"mail-type": "END"}}
    stock = stock_parameters(params)
    assert "requeue" not in stock and params["requeue"] == 2  # (the input is left as it was)
    # the user's lines, the requeue's, then the srun function's (tests/launch/
    # test_srun_restarts.py: it tells a stopped step from a failed one)
    assert stock["setup"][:3] == ["export SLURM_KILL_BAD_EXIT=1", "export AUTOMODEL_REQUEUE=2",
                                  "export AUTOMODEL_MAX_RESTARTS=0"]
    assert stock["setup"][3].startswith("srun() {")
    assert stock["additional_parameters"] == {"mail-type": "END", "requeue": True}
    assert stock["teardown"][0] == "automodel_rc=$?"  # (srun's exit code, read first)
    assert stock["teardown"][-1] == 'exit "$automodel_rc"'
    assert 'scontrol requeue "$SLURM_JOB_ID"' in stock["teardown"][1]
    off = stock_parameters({"nodes": 1, "requeue": 0, "setup": None})
    assert off == {"nodes": 1, "setup": [], "additional_parameters": {}}
    assert requeue_parameters(0) == {}


def test_a_task_knows_whether_a_failure_will_be_requeued(monkeypatch):
    monkeypatch.delenv("AUTOMODEL_REQUEUE", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert not requeue_follows()
    monkeypatch.setenv("AUTOMODEL_REQUEUE", "1")
    assert requeue_follows()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert not requeue_follows()


def test_a_fault_can_be_kept_to_one_run_of_a_requeued_job():
    assert [f.restart for f in parse("kill@3:2/0,nan@2,sleep@0.5/1")] == [0, None, 1]
    text = "kill@3:2/0,raise@4:2"
    assert [f.kind for f in Faults(2, text, restart=0).faults] == ["kill", "raise"]
    assert [f.kind for f in Faults(2, text, restart=1).faults] == ["raise"]
    assert Faults(1, text, restart=0).faults == []
    with pytest.raises(ValueError, match=r"kind@step\[:rank\]\[/restart\]"):
        parse("kill@3:2/x,boom@1")


def test_a_waiting_launcher_asks_slurm_for_the_job_states_at_a_steady_pace(monkeypatch):
    """submitit backs off to one state check per 10 minutes; while automodel's launchers wait,
    a thread asks every ``every_s`` (so a job lost after hours is reported within seconds).
    SLURM's answer is faked (submitit's ``watcher.update``, which runs ``sacct``): what is
    tested is the pace, whatever a cluster's database takes to answer, or whether one runs."""
    import time

    from submitit.slurm.slurm import SlurmJob

    from automodel.launch.slurm import job_states_refreshed

    calls = []
    monkeypatch.setattr(SlurmJob.watcher, "update", lambda: calls.append(time.monotonic()))
    monkeypatch.setattr("automodel.launch.slurm_request.cancel_jobs_that_never_start",
                        lambda jobs, reported: None)  # (squeue: faked likewise)
    with job_states_refreshed(every_s=0.05):
        time.sleep(0.5)  # the refresher's 0.05 s period, about 10 times
    assert len(calls) >= 3
    assert all(b - a >= 0.04 for a, b in zip(calls, calls[1:]))  # (a pace, not a spin)
    done = len(calls)
    time.sleep(0.2)  # a period after the block: the refresher must have stopped
    assert len(calls) == done  # (the thread ended with the block)


def test_the_option_reference_documents_requeue():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "options.md").read_text()
    assert "| `hydra.launcher.requeue` | int | 0 |" in text
