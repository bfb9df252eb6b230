"""Start the ranks of one job.

Inside torchrun (or another torch elastic agent) this process already is a rank. Otherwise,
with more than one process, start ``nproc_per_node`` local ranks through torch's elastic
launch API, each handed the same resolved ``TrainConfig`` and a fresh rendezvous port; if one
rank fails, the agent stops the others and the error names the failing rank.
"""

from __future__ import annotations

import logging
import os
import socket

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from automodel.config.resolve import TrainConfig
from automodel.launch.errors import LaunchError


log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@record
def _rank_entry(cfg: TrainConfig):
    from automodel.recipes.train import run_rank

    return run_rank(cfg)


def _failure_message(err) -> str:
    lines = []
    for rank, failure in sorted(err.failures.items()):
        detail = failure.message
        if isinstance(detail, dict):  # the error file's {"message": ..., "extraInfo": ...}
            detail = detail.get("message", detail)
        detail = str(detail).strip() or "no error message (killed by a signal?)"
        lines.append(f"rank {rank} failed (exit code {failure.exitcode}): {detail}")
    return "\n".join(lines)


def run_on_local_ranks(entry, nproc: int, *args, name: str = "automodel") -> dict:
    """Run ``entry(*args)`` on ``nproc`` spawned local ranks (torch's elastic launch, a fresh
    rendezvous port, no restarts). Returns {rank: result}; raises ChildFailedError."""
    port = free_port()
    log.info("starting %d local ranks, rendezvous at 127.0.0.1:%d", nproc, port)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"{name}-{os.getpid()}-{port}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn")
    return elastic_launch(config, entry)(*args)


def launch(cfg: TrainConfig):
    """Run the job; returns rank 0's result (its metric records)."""
    from automodel.recipes.train import run_rank

    if cfg.launch.kind == "slurm":  # this srun task is one rank
        from automodel.launch.slurm import export_rank_environment

        export_rank_environment()
        return run_rank(cfg)
    if cfg.launch.external or cfg.distributed.nproc_per_node == 1:
        return run_rank(cfg)

    nproc = cfg.distributed.nproc_per_node
    threads = max(1, (os.cpu_count() or 1) // nproc)
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "AUTOMODEL_NUM_THREADS")}
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("AUTOMODEL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
    try:
        results = run_on_local_ranks(_rank_entry, nproc, cfg)
    except ChildFailedError as err:
        raise LaunchError(_failure_message(err)) from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results[0]
