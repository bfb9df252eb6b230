"""Two nodes for real: SLURM's partition ``two`` of ``scripts/slurm_cluster.sh`` runs node1 and
node2 each in its own network namespace and hostname, joined by a virtual network, so ranks
on different nodes talk over that network (not a shared loopback) and find each other by the
first node's address.

Without that partition these tests skip, except under CI, where they fail with the reason
(``scripts/slurm_cluster.sh start`` says why it could not make the namespaces)."""

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.cli.test_cli import QUICK, ROOT, cli_args, metrics_files, run
from tests.helpers import BASE
from tests.launch.test_slurm import LAUNCHER, grad_norms, losses, require_cluster


def two_nodes_up() -> bool:
    """node1 and node2 of partition ``two`` answer: idle, or running another test's job (the
    suite's workers share the cluster; a job waits for the nodes)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "two", "-o", "%N %t"], capture_output=True,
                         text=True, timeout=10)
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    return out.returncode == 0 and set(states) == {"node1", "node2"} and all(
        state.rstrip("*") in ("idle", "mix", "alloc", "comp") for state in states.values())


@pytest.fixture(scope="module", autouse=True)
def _two_node_partition():
    require_cluster()
    if two_nodes_up():
        return
    reason = ("the cluster has no partition 'two' of node1 and node2 up (network "
              "namespaces); see the output of scripts/slurm_cluster.sh start")
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


TWO_NODES = ["hydra/launcher=slurm", "hydra.launcher.partition=two", "hydra.launcher.nodes=2",
             "hydra.launcher.tasks_per_node=2"]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """metrics.jsonl of FSDP2 and of HSDP (2 x 2) on 4 local ranks."""
    found = {}
    for name in ("fsdp2", "hsdp"):
        where = tmp_path_factory.mktemp(name)
        out = run([f"parallelism={name}", "mesh.dp_size=4"] + BASE, where)
        assert out.returncode == 0, out.stderr
        [found[name]] = metrics_files(where)
    return found


@contextlib.contextmanager
def _listeners():
    """Yields a set that receives (node, local address:port) of every listening socket a
    Python process holds in node1's or node2's namespace, polled while the block runs."""
    seen: set = set()
    done = threading.Event()

    def poll():
        while not done.is_set():
            for node in ("node1", "node2"):
                out = subprocess.run(["ip", "netns", "exec", f"amslurm-{node}", "ss", "-ltnpH"],
                                     capture_output=True, text=True).stdout
                seen.update((node, line.split()[3]) for line in out.splitlines()
                            if "python" in line)
            time.sleep(0.2)  # (poll: the listening sockets while the sweep runs)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()


def test_hsdp_on_two_nodes_matches_the_local_four_rank_run(local, tmp_path):
    """2 nodes x 2 tasks, HSDP replicating across the nodes and sharding within each: the same
    losses and grad norms as HSDP on 4 local ranks; the log says which ranks ran on which
    node, and each node's ranks reached the first node's address (not 127.0.0.1). Every port
    the ranks listen on is bound to their node's address on the virtual network, none to
    every interface. (FSDP2 over the two nodes, against the local run: the node-lost requeue
    test below, and torchrun across the nodes.)"""
    with _listeners() as seen:
        sweep = run(["-m", *TWO_NODES, "parallelism=hsdp", "mesh.dp_size=4",
                     f"hydra.sweep.dir={tmp_path}/sweep"] + BASE, tmp_path, timeout=900)
    assert sweep.returncode == 0, sweep.stderr
    assert {node for node, _ in seen} == {"node1", "node2"}, seen  # (the poll saw both)
    own = {"node1": "10.210.0.11", "node2": "10.210.0.12"}
    assert all(address.rsplit(":", 1)[0] == own[node] for node, address in seen), seen
    log = (tmp_path / "sweep" / "0" / "train.log").read_text()
    assert "ranks 0-1 on node1, ranks 2-3 on node2" in log, log
    assert "rendezvous at node1:" in log, log
    assert "spans nodes" not in log + sweep.stderr  # (HSDP: shard groups within a node)
    got = tmp_path / "sweep" / "0" / "metrics.jsonl"
    assert len(losses(got)) == 5
    np.testing.assert_allclose(losses(got), losses(local["hsdp"]), rtol=1e-6)
    np.testing.assert_allclose(grad_norms(got), grad_norms(local["hsdp"]), rtol=1e-5)


def _on_node(node: str, command: list) -> list:
    """``command`` run as on ``node``: in its network namespace, with its hostname (as the
    cluster script starts its slurmd)."""
    return ["nsenter", f"--net=/run/netns/amslurm-{node}", "unshare", "--uts", "sh", "-c",
            f'hostname {node} && exec "$@"', "sh", *command]


def test_torchrun_across_the_two_nodes_matches_the_local_four_rank_run(local, tmp_path):
    """torchrun on node1 and on node2 (2 ranks each), meeting at node1's c10d rendezvous over
    the virtual network, gloo told its interface (``GLOO_SOCKET_IFNAME``): the same losses and
    grad norms as FSDP2 on 4 local ranks, node1's ranks first."""
    port = str(29400 + os.getpid() % 500)
    out = tmp_path / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"node1:{port}", "--rdzv-id", f"two-nodes-{port}", str(ROOT / "train.py")]
    args = cli_args(["parallelism=fsdp2", "mesh.dp_size=4", f"hydra.run.dir={out}"] + BASE)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="am0")  # (the node's virtual network card)
    procs = [subprocess.Popen(_on_node(node, torchrun + args), cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in ("node2", "node1")]  # (the order they join does not decide the ranks)
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    np.testing.assert_allclose(losses(out / "metrics.jsonl"), losses(local["fsdp2"]), rtol=1e-6)
    np.testing.assert_allclose(grad_norms(out / "metrics.jsonl"), grad_norms(local["fsdp2"]),
                               rtol=1e-5)
    log = (out / "train.log").read_text()
    assert "ranks 0-1 on node1, ranks 2-3 on node2" in log, log
    assert "rendezvous at node1:" in log, log


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


def test_a_node_lost_with_requeue_on_resumes_and_ends_like_the_uninterrupted_run(local,
                                                                                 tmp_path):
    """node2's ranks die at step 3 of the first run (checkpoints every 2 steps); with
    ``hydra.launcher.requeue=1`` the job script requeues the job, which resumes from step 2's
    checkpoint on both nodes and ends with the losses and grad norms of the uninterrupted
    4-rank run."""
    from tests.launch.test_slurm_faults import release_when_requeued, sweep_job_id

    sweep = tmp_path / "sweep"
    env = dict(os.environ, AUTOMODEL_FAULTS="kill@3:2/0,kill@3:3/0")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "-m", *TWO_NODES, "hydra.launcher.requeue=1",
         f"hydra.sweep.dir={sweep}", "parallelism=fsdp2", "mesh.dp_size=4",
         "checkpoint.every_steps=2"] + BASE,
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = sweep_job_id(sweep)
    release_when_requeued(job_id, timeout=300)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    got = sweep / "0" / "metrics.jsonl"
    assert [r["step"] for r in map(json.loads, got.read_text().splitlines())] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(losses(got), losses(local["fsdp2"]), rtol=1e-6)
    np.testing.assert_allclose(grad_norms(got), grad_norms(local["fsdp2"]), rtol=1e-5)
    log = (sweep / "0" / "train.log").read_text()
    assert re.search(r"SLURM requeued this job \(restart 1\): resuming", log), log
    batch_log = (sweep / ".submitit" / job_id / f"{job_id}_0_log.err").read_text()
    assert re.search(r"srun: error: node2: tasks? 2(-3)?: Killed", batch_log), batch_log
    assert (f"requeueing SLURM job {job_id} (requeue 1 of 1): it resumes from its last "
            "complete checkpoint") in batch_log, batch_log


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
    out = run(["--nodes", "2", "--tasks-per-node", "2", "--partition", "two",
               "--output-dir", str(tmp_path / "tp4"), "parallelism=fsdp2", "mesh.tp_size=4",
               "mesh.dp_size=1", "model.config.num_key_value_heads=4"] + QUICK, ROOT,
              cmd=LAUNCHER, timeout=600)
    assert out.returncode == 0, out.stderr  # (a warning: the layout runs, only slower)
    assert "mesh axis tp spans nodes (ranks 0-1 on node 0, ranks 2-3 on node 1)" in out.stderr, \
        out.stderr
    job_id = re.search(r"submitted SLURM job (\d+)", out.stdout).group(1)  # (it was queued)
    subprocess.run(["scancel", job_id], check=True)


def test_layout_auto_on_two_nodes_searches_at_submit_and_keeps_tp_within_a_node(tmp_path,
                                                                               monkeypatch):
    """``layout=auto`` on 2 nodes x 2 tasks: the submitter searches the layouts of 4 ranks in
    nodes of 2 (the nodes' memory from sinfo), none with tensor parallelism across the nodes;
    the job's tasks compose the chosen layout (no search of their own) and train it on both
    nodes; its command, printed in plan.json, is the tasks' config. ``python -m
    launchers.slurm`` resolves the same job to the same layout (the search cached)."""
    sweep = tmp_path / "sweep"
    out = run(["-m", *TWO_NODES, "layout=auto", f"hydra.sweep.dir={sweep}"] + BASE, tmp_path,
              timeout=900, env_extra={"AUTOMODEL_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr[-3000:]
    search = json.loads((sweep / "0" / "search.json").read_text())
    assert search["gpus"] == 4 and search["gpu"]["gpus_per_node"] == 2
    assert search["searched"] > 1 and all(e["candidate"]["tp"] <= 2 for e in search["top"])
    plan = json.loads((sweep / "0" / "plan.json").read_text())
    log = (sweep / "0" / "train.log").read_text()
    assert "ranks 0-1 on node1, ranks 2-3 on node2" in log and "layout=auto:" not in log
    c = plan["layout"]
    assert f"(dp={c['dp_replicate'] * c['dp_shard']}, cp={c['cp']}, tp={c['tp']}, " \
           f"pp={c['pp']}" in log, log[:2000]
    overrides = (sweep / "0" / ".hydra" / "overrides.yaml").read_text()
    assert "layout=manual" in overrides and all(o in overrides for o in plan["overrides"])
    assert len(losses(sweep / "0" / "metrics.jsonl")) == 5
    from tests.launch.test_auto_layout import assert_plan_check

    assert_plan_check(sweep / "0")  # (the submitter's plan, checked by the tasks)
    # the nodes' memory: the named partition's, else the default one's (debug, marked by sinfo)
    from automodel.prepare.device_profiles import slurm_profile

    assert search["gpu"]["hbm_bytes"] == slurm_profile("two", 2).hbm_bytes
    assert slurm_profile(None, 2).hbm_bytes > slurm_profile("two", 2).hbm_bytes
    # the submitter of launchers.slurm: the same search (cached), the job's overrides
    import argparse

    from launchers.slurm import resolve_job

    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path / "cache"))
    searches = sorted((tmp_path / "cache" / "layout").glob("*.json"))
    assert len(searches) == 1, searches
    # (the same job: its overrides as the command line above had them, CPU pin included)
    args = argparse.Namespace(nodes=2, tasks_per_node=2, partition="two", gpus_per_node=None,
                              overrides=cli_args(["layout=auto", *BASE]))
    cfg, submitted = resolve_job(args, str(tmp_path / "direct"))
    assert sorted((tmp_path / "cache" / "layout").glob("*.json")) == searches  # (reused)
    assert cfg.layout_mode == "manual" and "layout=manual" in submitted
    assert all(o in submitted for o in plan["overrides"]) and cfg.layout.world_size == 4
    direct = json.loads((tmp_path / "direct" / "plan.json").read_text())
    assert direct["overrides"] == plan["overrides"] and "check" in direct
