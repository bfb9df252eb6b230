"""Two nodes for real: SLURM's partition ``two`` of ``scripts/slurm_cluster.sh`` runs node1 and
node2 each in its own network namespace and hostname, joined by a virtual network, so ranks
on different nodes talk over that network (not a shared loopback) and find each other by the
first node's address.

Without that partition these tests skip, except under CI, where they fail with the reason
(``scripts/slurm_cluster.sh start`` says why it could not make the namespaces)."""

import os
import re
import subprocess
import time

import numpy as np
import pytest

from tests.cli.test_cli import QUICK, ROOT, metrics_files, run
from tests.helpers import BASE
from tests.launch.test_slurm import LAUNCHER, grad_norms, losses, require_cluster


def _two_nodes_idle() -> bool:
    out = subprocess.run(["sinfo", "-h", "-p", "two", "-o", "%D %t"], capture_output=True,
                         text=True, timeout=10)
    return out.returncode == 0 and "2 idle" in out.stdout


@pytest.fixture(scope="module", autouse=True)
def _two_node_partition():
    require_cluster()
    if _two_nodes_idle():
        return
    reason = ("the cluster has no idle partition 'two' of node1 and node2 (network "
              "namespaces); see the output of scripts/slurm_cluster.sh start")
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


TWO_NODES = ["hydra/launcher=slurm", "hydra.launcher.partition=two", "hydra.launcher.nodes=2",
             "hydra.launcher.tasks_per_node=2"]


def test_fsdp2_and_hsdp_on_two_nodes_match_the_local_four_rank_runs(tmp_path):
    """2 nodes x 2 tasks: FSDP2 over the 4 ranks, and HSDP replicating across the nodes and
    sharding within each: the same losses and grad norms as the same layouts on 4 local
    ranks; the log says which ranks ran on which node, and each node's ranks reached the
    first node's address (not 127.0.0.1)."""
    local = {}
    for name in ("fsdp2", "hsdp"):
        (tmp_path / name).mkdir()
        out = run([f"parallelism={name}", "mesh.dp_size=4"] + BASE, tmp_path / name)
        assert out.returncode == 0, out.stderr
        [local[name]] = metrics_files(tmp_path / name)
    sweep = run(["-m", *TWO_NODES, "parallelism=fsdp2,hsdp", "mesh.dp_size=4",
                 f"hydra.sweep.dir={tmp_path}/sweep"] + BASE, tmp_path, timeout=900)
    assert sweep.returncode == 0, sweep.stderr
    for job, name in (("0", "fsdp2"), ("1", "hsdp")):
        log = (tmp_path / "sweep" / job / "train.log").read_text()
        assert "ranks 0-1 on node1, ranks 2-3 on node2" in log, log
        assert "rendezvous at node1:" in log, log
        got = tmp_path / "sweep" / job / "metrics.jsonl"
        assert len(losses(got)) == 5
        np.testing.assert_allclose(losses(got), losses(local[name]), rtol=1e-6)
        np.testing.assert_allclose(grad_norms(got), grad_norms(local[name]), rtol=1e-5)


def test_a_node_lost_mid_run_ends_the_job_promptly_and_is_named(tmp_path):
    """node2's two ranks kill themselves (SIGKILL) at step 3: srun stops node1's ranks, the
    launcher returns well within the 10-minute collective timeout, naming node2."""
    start = time.monotonic()
    out = run(["--wait", "--nodes", "2", "--tasks-per-node", "2", "--partition", "two",
               "--output-dir", str(tmp_path / "job"), "distributed.timeout_minutes=10",
               "parallelism=fsdp2", "mesh.dp_size=4"] + QUICK, ROOT, cmd=LAUNCHER,
              env_extra={"AUTOMODEL_FAULTS": "kill@3:2,kill@3:3"}, timeout=600)
    elapsed = time.monotonic() - start
    assert out.returncode == 1, out.stderr
    assert re.search(r"SLURM job \d+ failed: rank [23](-3)? on node2 ended first \(Killed\)",
                     out.stderr), out.stderr
    assert elapsed < 240, f"{elapsed:.0f} s"


def test_two_node_jobs_are_checked_before_submission(tmp_path):
    """At submit time, against the world of 2 nodes x 2 tasks: a bad TP plan is refused and
    nothing is queued; a TP group that would span the nodes is warned about, naming the
    axis (the job is valid: it is submitted and runs)."""
    from tests.launch.test_slurm_preflight import (
        BAD_PLAN,
        NO_SUCH_MODULE,
        jobs_started_in,
        refused,
    )

    sweep = tmp_path / "sweep"
    out = run(["-m", *TWO_NODES, "parallelism=fsdp2", "mesh.tp_size=2", BAD_PLAN,
               f"hydra.sweep.dir={sweep}"] + QUICK, tmp_path)
    refused(out, "sweep job #0 (", "refused before anything was submitted", NO_SUCH_MODULE)
    assert not (sweep / ".submitit").exists() and jobs_started_in(tmp_path) == []
    out = run(["--wait", "--nodes", "2", "--tasks-per-node", "2", "--partition", "two",
               "--output-dir", str(tmp_path / "tp4"), "parallelism=fsdp2", "mesh.tp_size=4",
               "mesh.dp_size=1", "model.config.num_key_value_heads=4"] + QUICK, ROOT,
              cmd=LAUNCHER, timeout=600)
    assert out.returncode == 0, out.stderr  # (a warning: the layout runs, only slower)
    assert "mesh axis tp spans nodes (ranks 0-1 on node 0, ranks 2-3 on node 1)" in out.stderr, \
        out.stderr
