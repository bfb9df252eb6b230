"""Preemption and a dead rank on the real local SLURM cluster (see test_slurm.py).

Preemption is what SLURM does to a job: SIGTERM and submitit's USR2 to every task (what
``scancel --signal`` delivers, and what submitit's own ``job._interrupt()`` sends). The job
must finish its step, save, requeue itself through submitit, resume on its own once SLURM
runs it again, and end with the uninterrupted run's losses. SLURM holds a requeued job for
about two minutes before it is eligible again; the test makes it eligible at once with
``scontrol update StartTime=now`` (that is the only thing it shortcuts).
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.cli.test_cli import ROOT, run
from tests.helpers import ON_CPU, train
from tests.launch.test_slurm import LAUNCHER, require_cluster


@pytest.fixture(scope="module", autouse=True)
def _slurm_cluster():
    # no cluster: skip, or under CI fail (see test_slurm.py); before `uninterrupted` runs
    require_cluster()


STEPS = 30
JOB = ["parallelism=ddp", "data=synthetic", "data.num_sequences=64", f"trainer.max_steps={STEPS}",
       "trainer.log_every=1", "trainer.global_batch_size=8", "trainer.seq_len=16"] + ON_CPU


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _state(job_id):
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    state = re.search(r"JobState=(\S+)", out.stdout)
    restarts = re.search(r"Restarts=(\d+)", out.stdout)
    return (state.group(1) if state else "?"), int(restarts.group(1)) if restarts else 0


def _preempt_and_release(job_id, metrics, at_step=5):
    deadline = time.time() + 180
    while time.time() < deadline and len(_records(metrics)) < at_step:
        time.sleep(0.3)  # (poll: until the job has logged at_step steps)
    assert len(_records(metrics)) >= at_step, "the job never got going"
    for sig in ("TERM", "USR2"):  # SLURM's preemption notice, then submitit's signal
        subprocess.run(["scancel", f"--signal={sig}", job_id], check=True)
    release_when_requeued(job_id)


def sweep_job_id(sweep, timeout=120) -> str:
    """The SLURM job id of the first job a Hydra sweep into ``sweep`` submits (waits for it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = list(sweep.glob(".submitit/*/*_submitted.pkl"))
        if found:
            return found[0].name.split("_")[0]
        time.sleep(0.3)  # (poll: until the sweep submitted its job)
    raise AssertionError("the sweep submitted no job")


def release_when_requeued(job_id, timeout=120):
    """Wait for ``job_id``'s first requeue, then skip SLURM's hold of the requeued job."""
    deadline = time.time() + timeout
    while time.time() < deadline:  # wait for the requeue, then skip SLURM's hold
        state, restarts = _state(job_id)
        if restarts >= 1 and state == "PENDING":
            # (slurmd refuses to start a job again within the second its old run's credential
            # was revoked: "Job credential revoked"; SLURM's own hold is two minutes)
            time.sleep(2)
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"],
                           check=True)
            return
        time.sleep(0.3)  # (poll: until SLURM requeues the job)
    raise AssertionError(f"job {job_id} was not requeued: {_state(job_id)}")


def _final_state(job_id):
    deadline = time.time() + 60  # the results can be in before SLURM closes the job
    while _state(job_id)[0] in ("RUNNING", "COMPLETING") and time.time() < deadline:
        time.sleep(0.3)  # (poll: until SLURM closes the job)
    return _state(job_id)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return train(JOB[1:], tmp_path_factory.mktemp("full"), base=["parallelism=ddp"])


def test_preempted_job_requeues_resumes_and_ends_like_an_uninterrupted_run(uninterrupted,
                                                                           tmp_path):
    out = tmp_path / "job"
    env = dict(os.environ, AUTOMODEL_FAULTS="sleep@0.2")
    launcher = subprocess.Popen(LAUNCHER + ["--wait", "--tasks-per-node", "2", "--output-dir",
                                            str(out)] + JOB, cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = launcher.stdout.readline()
    job_id = re.search(r"submitted SLURM job (\d+)", line).group(1)
    _preempt_and_release(job_id, out / "metrics.jsonl")
    stdout, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr
    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # nothing lost or redone
    assert [r["step"] for r in uninterrupted] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in uninterrupted]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in uninterrupted]
    assert f"final loss {uninterrupted[-1]['loss']:.4f}" in stdout
    log = (out / "train.log").read_text()
    # (SLURM does not promise which of the two signals reaches the tasks first)
    assert re.search(r"stopped by SIG(TERM|USR2) after step (\d+); checkpoint saved", log)
    assert "SLURM job requeued through submitit" in log
    assert re.search(r"SLURM requeued this job \(restart 1\): resuming", log)
    assert _final_state(job_id) == ("COMPLETED", 1)


def test_preempted_hydra_sweep_job_resumes(uninterrupted, tmp_path):
    sweep = tmp_path / "sweep"
    env = dict(os.environ, AUTOMODEL_FAULTS="sleep@0.2")
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=slurm",
                             "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={sweep}"] + JOB,
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    job_id = sweep_job_id(sweep)
    _preempt_and_release(job_id, sweep / "0" / "metrics.jsonl")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    records = _records(sweep / "0" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["step"] for r in uninterrupted] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in uninterrupted]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in uninterrupted]
    assert _final_state(job_id) == ("COMPLETED", 1)


def test_dead_rank_fails_the_job_promptly_and_is_named(tmp_path):
    # Bound: the launcher returns within 180 s of submitting (measured 12-25 s, most of it
    # start-up and the submit-time preflight); a hang would wait for the 10-minute collective
    # timeout set here, so the bound separates the two with room for a slow machine.
    start = time.monotonic()
    out = run(["--wait", "--tasks-per-node", "2", "--output-dir", str(tmp_path / "job"),
               "distributed.timeout_minutes=10"] + JOB, ROOT, cmd=LAUNCHER,
              env_extra={"AUTOMODEL_FAULTS": "kill@3:1"})
    elapsed = time.monotonic() - start
    assert out.returncode == 1
    assert re.search(r"SLURM job \d+ failed: rank 1 on localhost ended first \(Killed\)",
                     out.stderr)
    assert elapsed < 180, f"{elapsed:.0f} s"
    # the same through a Hydra sweep on SLURM: the sweep fails, srun's line names the rank
    start = time.monotonic()
    sweep = run(["-m", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2",
                 f"hydra.sweep.dir={tmp_path}/sweep", "distributed.timeout_minutes=10"] + JOB,
                tmp_path, env_extra={"AUTOMODEL_FAULTS": "kill@3:1"})
    elapsed = time.monotonic() - start
    assert sweep.returncode != 0
    assert re.search(r"task 1: Killed", sweep.stderr), sweep.stderr
    assert elapsed < 180, f"{elapsed:.0f} s"


def test_a_failing_rank_names_its_root_cause(tmp_path):
    # a chained exception in rank 1 at step 2: the launcher's line names the rank, the phase
    # and the root cause (from the rank's own log line)
    out = run(["--wait", "--tasks-per-node", "2", "--output-dir", str(tmp_path / "job")] + JOB,
              ROOT, cmd=LAUNCHER, env_extra={"AUTOMODEL_FAULTS": "raise@2:1"})
    assert out.returncode == 1
    assert re.search(r"SLURM job \d+ failed.*; rank 1 failed during step 2: ValueError: injected "
                     r"root cause at step 2 \(raised as RuntimeError: injected wrapper\)",
                     out.stderr), out.stderr


def _batch_log(folder) -> str:
    """The job script's own output (its echo lines and srun's), across the job's runs."""
    return "".join(p.read_text() for p in sorted(folder.glob(".submitit/*/*_0_log.err")))


def test_requeue_is_bounded_comes_after_the_restarts_and_a_job_failing_again_fails(tmp_path):
    """``--requeue 1``, ``distributed.max_restarts=1`` and a rank that dies at step 3 of every
    run: in each SLURM run of the job the srun function starts the ranks again once (resumed
    from step 2, dying again), and only then does the job script requeue the job, once; the
    requeued run spends its restart too, is not requeued a second time, and ends FAILED (the
    job script keeps srun's exit code), named as before."""
    out = tmp_path / "job"
    env = dict(os.environ, AUTOMODEL_FAULTS="kill@3:1")
    launcher = subprocess.Popen(LAUNCHER + ["--wait", "--tasks-per-node", "2", "--requeue", "1",
                                            "--output-dir", str(out), "checkpoint.every_steps=2",
                                            "distributed.timeout_minutes=10",
                                            "distributed.max_restarts=1"] + JOB,
                                cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    job_id = re.search(r"submitted SLURM job (\d+)", launcher.stdout.readline()).group(1)
    release_when_requeued(job_id, timeout=180)
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 1, stderr
    assert re.search(r"SLURM job \d+ failed: rank 1 on localhost ended first \(Killed\)", stderr)
    assert _final_state(job_id) == ("FAILED", 1)
    assert [r["step"] for r in _records(out / "metrics.jsonl")] == [1, 2]  # 4 times to step 2
    batch = _batch_log(out)
    restarted = [m.start() for m in re.finditer(
        r"starting the job's ranks again \(in-job restart 1 of distributed.max_restarts=1\)",
        batch)]
    requeued = batch.index(f"requeueing SLURM job {job_id} (requeue 1 of 1)")
    assert len(restarted) == 2 and restarted[0] < requeued < restarted[1], batch
    log = (out / "train.log").read_text()
    assert re.search(r"SLURM requeued this job \(restart 1\): resuming", log), log
    assert "(in-job restart 1 of distributed.max_restarts=1): resuming" in log


def test_a_rank_killed_once_is_restarted_inside_the_allocation(uninterrupted, tmp_path):
    """A Hydra sweep job with ``distributed.max_restarts=1`` (and a requeue it must not need):
    rank 1 killed at step 3 of the first attempt only; srun starts the ranks again in the same
    SLURM run, they resume from step 2's checkpoint, and the job completes with every step
    once, the uninterrupted run's losses and gradient norms, and no requeue."""
    sweep = tmp_path / "sweep"
    out = run(["-m", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2",
               "hydra.launcher.requeue=1", f"hydra.sweep.dir={sweep}",
               "distributed.max_restarts=1", "checkpoint.every_steps=2"] + JOB, tmp_path,
              env_extra={"AUTOMODEL_FAULTS": "kill@3:1/0"})
    assert out.returncode == 0, out.stderr
    records = _records(sweep / "0" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["grad_norm"]) for r in records] == \
        [(r["loss"], r["grad_norm"]) for r in uninterrupted]
    batch = _batch_log(sweep)
    assert batch.count("starting the job's ranks again (in-job restart 1 of") == 1, batch
    assert "requeueing" not in batch
    assert "(in-job restart 1 of distributed.max_restarts=1): resuming from the run's newest " \
           "checkpoint" in \
        (sweep / "0" / "train.log").read_text()
    assert _final_state(sweep_job_id(sweep)) == ("COMPLETED", 0)


def test_a_batch_script_restarts_a_failed_step_but_not_a_stopped_one(uninterrupted, tmp_path):
    """A plain batch script (no submitit) that defines the srun function as docs/slurm.md says
    and passes ``distributed.max_restarts=2`` on its srun line: rank 1 killed at step 3 of the
    first attempt, the step runs again and resumes from step 2; then a user's SIGUSR1 to the
    ranks: they save and stop, and although a restart is left the step is not run again. The
    job ends with 138 (128 + SIGUSR1), every step once, the uninterrupted run's losses."""
    out = tmp_path / "run"
    python = ROOT / ".venv" / "bin" / "python"
    script = tmp_path / "job.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash", "#SBATCH --ntasks=2", "#SBATCH --partition=debug",
        f"#SBATCH --output={tmp_path}/slurm.out", f"cd {ROOT}",
        f'eval "$({python} -m automodel.launch.restarts)"',
        f"srun {python} {ROOT / 'train.py'} hydra.run.dir={out} distributed.max_restarts=2 "
        + " ".join(["checkpoint.every_steps=2"] + JOB)]) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env["AUTOMODEL_FAULTS"] = "kill@3:1/0,sleep@0.2"
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], env=env, check=True,
                            capture_output=True, text=True).stdout.strip().split(";")[0]
    deadline = time.time() + 180
    log = out / "train.log"
    while time.time() < deadline and not (log.exists() and "in-job restart 1" in log.read_text()
                                          and len(_records(out / "metrics.jsonl")) >= 5):
        time.sleep(0.3)  # (poll: until the restarted step has logged step 5)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    assert _final_state(job_id) == ("FAILED", 0)
    exit_code = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                               text=True).stdout
    assert re.search(r"\bExitCode=138:0", exit_code), exit_code
    batch = (tmp_path / "slurm.out").read_text()
    assert batch.count("starting the job's ranks again") == 1, batch
    assert "(in-job restart 1 of distributed.max_restarts=2)" in batch
    stop = re.search(r"stopped by SIGUSR1 after step (\d+); checkpoint saved", log.read_text())
    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, int(stop.group(1)) + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in uninterrupted[:len(records)]]


def test_a_request_that_can_never_start_is_refused_or_cancelled_with_its_reason(tmp_path,
                                                                               capfd):
    """Two nodes on partition debug (one node): refused before anything is submitted, naming
    the key, the partition's size and the partition where it fits. A job SLURM holds for a
    reason that never passes (here submitted by plain sbatch, 3 nodes of partition two's 2:
    PartitionNodeLimit) is named with its reason and cancelled by the waiting launcher's
    watcher, within seconds."""
    sweep = run(["-m", "hydra/launcher=slurm", "hydra.launcher.nodes=2",
                 f"hydra.sweep.dir={tmp_path}/sweep"] + JOB, tmp_path)
    assert sweep.returncode == 2, sweep.stderr
    assert "hydra.launcher.nodes=2, but partition debug has 1 node" in sweep.stderr
    assert "a partition where it fits: two" in sweep.stderr
    assert not (tmp_path / "sweep" / ".submitit").exists()  # (nothing submitted)

    from submitit.slurm.slurm import SlurmJob

    from automodel.launch.slurm import job_states_refreshed

    job_id = subprocess.run(["sbatch", "--parsable", "--partition=two", "--nodes=3",
                             "--wrap", "true"], capture_output=True, text=True, check=True,
                            cwd=tmp_path).stdout.strip().split(";")[0]
    watcher = SlurmJob.watcher
    watcher.register_job(job_id)
    try:
        with job_states_refreshed(every_s=0.2):
            deadline = time.time() + 60
            while time.time() < deadline and _state(job_id)[0] == "PENDING":
                time.sleep(0.3)  # (poll: until the watcher cancels the job)
    finally:
        watcher._registered.discard(job_id)
        subprocess.run(["scancel", job_id])
    assert _final_state(job_id)[0] == "CANCELLED"
    err = capfd.readouterr().err
    # (SLURM's first reason, PartitionNodeLimit, becomes PartitionConfig at its next pass)
    assert re.search(rf"SLURM job {job_id} can never start \(reason Partition(NodeLimit|Config)",
                     err), err
    assert "NumNodes=3" in err and "Partition=two" in err
