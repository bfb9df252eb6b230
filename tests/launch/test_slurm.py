"""SLURM through submitit, on a real one-node cluster (``scripts/slurm_cluster.sh start``,
which ``.ci/run`` runs before the tests). Each test uses its own submitit folder: job ids
restart at 1 on a fresh cluster.

Without a cluster these tests skip, except under CI (the ``CI`` environment variable set, as
``.ci/run`` and most CI services do): there a missing cluster fails them, so a CI run whose
cluster did not start cannot pass with its SLURM tests silently skipped."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from automodel.config.launch_env import usable_cpus
from automodel.tracking.metrics import read_metrics
from tests.cli.test_cli import QUICK, ROOT, metrics_files, run
from tests.distributed.test_parity import assert_matches
from tests.helpers import BASE


@functools.lru_cache(maxsize=None)
def _cluster_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mix", "alloc"))


NO_CLUSTER = ("no SLURM cluster answers (sinfo); start one with: "
              "bash scripts/slurm_cluster.sh start")


def require_cluster():
    """Skip without a cluster; under CI fail instead, saying the cluster did not start."""
    if _cluster_answers():
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"the SLURM cluster did not start: no cluster answers sinfo, and "
                    f"CI={os.environ['CI']} is set, so the SLURM tests fail instead of skipping "
                    "(see the output of scripts/slurm_cluster.sh start in the CI log)",
                    pytrace=False)
    pytest.skip(NO_CLUSTER)


@pytest.fixture(scope="module", autouse=True)
def _slurm_cluster():
    # module scope and autouse: checked before any other module fixture starts a run
    require_cluster()


LAUNCHER = [sys.executable, "-m", "launchers.slurm"]


def losses(path, key="loss"):
    values = [json.loads(line)[key] for line in open(path)]
    assert values, f"{path} holds no records"
    return values


def grad_norms(path):
    return losses(path, "grad_norm")


def test_single_rank_job_with_wait(tmp_path, reference):
    # the parity tests' job (tests.helpers.BASE): the single-process reference's numbers
    out = run(["--wait", "--output-dir", str(tmp_path / "job"), "parallelism=none"] + BASE,
              ROOT, cmd=LAUNCHER)
    assert out.returncode == 0, out.stderr
    assert re.search(r"submitted SLURM job \d+", out.stdout)
    assert_matches(read_metrics(tmp_path / "job" / "metrics.jsonl"), reference())


def test_two_task_fsdp2_sweep_matches_the_local_run(tmp_path, reference):
    (tmp_path / "local").mkdir()
    local = run(["parallelism=fsdp2"] + BASE, tmp_path / "local")
    assert local.returncode == 0, local.stderr
    [local_metrics] = metrics_files(tmp_path / "local")
    # (no OMP_NUM_THREADS: the tasks pick their threads themselves)
    sweep = run(["-m", "hydra/launcher=slurm", "hydra.launcher.nodes=1",
                 "hydra.launcher.tasks_per_node=2", "parallelism=ddp,fsdp2",
                 f"hydra.sweep.dir={tmp_path}/sweep"] + BASE, tmp_path,
                env_extra={"OMP_NUM_THREADS": None})
    assert sweep.returncode == 0, sweep.stderr
    # the node's CPUs shared by its 2 tasks (torch's default: every CPU in each task)
    threads = max(1, usable_cpus() // 2)
    assert usable_cpus() == 1 or threads != usable_cpus()
    for job in ("0", "1"):  # both jobs of the sweep, each 2 SLURM tasks = 2 ranks
        log = (tmp_path / "sweep" / job / "train.log").read_text()
        assert "on 2 rank(s) (dp=2" in log and log.count("step 5/5") == 1  # rank 0 only
        assert f"device cpu, {threads} CPU thread{'s' if threads > 1 else ''} per rank" in log
    # job 0 is DDP (fp32) on 2 SLURM tasks: the single-process reference's numbers
    assert_matches(read_metrics(tmp_path / "sweep" / "0" / "metrics.jsonl"), reference())
    # job 1 is FSDP2 (bf16 parameters) on 2 SLURM tasks: the same numbers as the local 2-rank
    # FSDP2 run
    assert len(losses(local_metrics)) == 5
    np.testing.assert_allclose(losses(tmp_path / "sweep" / "1" / "metrics.jsonl"),
                               losses(local_metrics), rtol=1e-6)
    np.testing.assert_allclose(grad_norms(tmp_path / "sweep" / "1" / "metrics.jsonl"),
                               grad_norms(local_metrics), rtol=1e-5)


def test_failing_job_is_reported_failed_with_its_log(tmp_path):
    out = run(["--wait", "--output-dir", str(tmp_path / "job"),
               "+model.config.hidden_act=no_such_act", "parallelism=none"] + QUICK,
              ROOT, cmd=LAUNCHER)
    assert out.returncode == 1
    # srun's own line for the task ("rank 0 on localhost ended first (...)") shows when it
    # reached the batch log before the launcher read it: a race, so either form is right
    assert re.search(r"SLURM job \d+ failed(: rank 0 on localhost ended first \([^)]*\))?; "
                     r"rank 0 failed during model build: KeyError: 'no_such_act' \(traceback: "
                     r"\S+/traceback_rank0\.txt\); log: \S+\.err",
                     out.stderr), out.stderr
    sweep = run(["-m", "hydra/launcher=slurm", "+model.config.hidden_act=no_such_act",
                 "parallelism=none", f"hydra.sweep.dir={tmp_path}/sweep"] + QUICK, tmp_path)
    assert sweep.returncode != 0 and "no_such_act" in sweep.stderr
    # the SLURM job itself failed (not "completed"), and the message names its log
    assert "state: FAILED" in sweep.stderr
    assert re.search(r"log: \S+/\.submitit/\d+/\d+_0_log\.err", sweep.stderr)


def test_cancellation(tmp_path):
    out = run(["--output-dir", str(tmp_path / "job"), "parallelism=none", "data=synthetic",
               "trainer.max_steps=100000", "trainer.log_every=100"], ROOT, cmd=LAUNCHER)
    assert out.returncode == 0, out.stderr
    job_id = re.search(r"submitted SLURM job (\d+)", out.stdout).group(1)
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until it is running
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                               text=True).stdout.strip()
        if state == "RUNNING":
            break
        time.sleep(0.5)  # (poll: until the job runs)
    assert state == "RUNNING"
    subprocess.run(["scancel", job_id], check=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        state = subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "State"],
                               capture_output=True, text=True).stdout.strip()
        if state.startswith("CANCELLED"):
            break
        time.sleep(0.5)  # (poll: until SLURM records the cancellation)
    assert state.startswith("CANCELLED")
