"""Start the ranks of one job.

Inside torchrun (or another torch elastic agent) this process already is a rank. Otherwise,
with more than one process, start ``nproc_per_node`` local ranks through torch's elastic
launch API (forked from a server that imported torch, transformers and automodel once:
runtime/forkserver.py), each handed the same resolved ``TrainConfig`` and a fresh rendezvous
port; if one rank fails, the agent stops the others and the error names the failing rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import uuid

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from automodel.config.build import ConfigError
from automodel.config.launch_env import THREADS_ENV, rank_threads, usable_cpus
from automodel.config.resolve import TrainConfig
from automodel.errors import LaunchError, TrainingStopped
from automodel.launch.restarts import check_outer_restarts
from automodel.runtime import failure, forkserver
from automodel.runtime.attempts import ALLOWED_ENV
from automodel.runtime.signals import STOP_SIGNALS

log = logging.getLogger(__name__)


# The rendezvous endpoint: port 0, as ``torchrun --standalone`` does. The elastic agent (this
# process) then binds its stores on ports the OS picks and keeps them bound; the ranks learn the
# port from the agent (MASTER_PORT, as clients of the agent's store). No port is chosen free,
# released and bound again later, so hundreds of launches in one process cannot race for one.
RENDEZVOUS_HOST = "127.0.0.1"  # local ranks only: they meet over loopback (MASTER_ADDR)
RENDEZVOUS_ENDPOINT = f"{RENDEZVOUS_HOST}:0"


@record
def _rank_entry(cfg: TrainConfig, channel=None):
    from automodel.recipes.train import run_rank

    failure.connect(channel)
    try:
        return run_rank(cfg)
    except TrainingStopped as stopped:  # a clean end: exit now with the shell's code for the
        # signal (the agent may be shutting down and no longer collects results)
        sys.exit(stopped.exit_code)
    except BaseException as err:  # (torch.distributed.checkpoint's errors are BaseExceptions)
        if not isinstance(err, (SystemExit, KeyboardInterrupt)):
            failure.report(err, int(os.environ.get("RANK", 0)))
            failure.let_the_cause_exit_first(err)
        raise


def _failure_message(err, channel) -> str:
    reports = {}
    while channel is not None and not channel.empty():
        rank, where, what = channel.get()
        reports.setdefault(rank, (where, what))  # (a rank's first report)
    failures = {}
    for rank, f in err.failures.items():
        detail = f.message
        if isinstance(detail, dict):  # the error file's {"message": ..., "extraInfo": ...}
            detail = detail.get("message", detail)
        failures[rank] = (f.exitcode, str(detail).strip())
    return failure.launcher_message(failures, reports)


def _run_here(cfg: TrainConfig, external: bool):
    """This process is the rank (one process, torchrun, a SLURM task): its failure is
    summarized on its stderr and, under torch elastic, in the error file the agent reads."""
    from automodel.checkpoint.verify import CheckpointError
    from automodel.recipes.train import run_rank

    try:
        return run_rank(cfg)
    except (TrainingStopped, CheckpointError, SystemExit, KeyboardInterrupt):
        raise  # (a checkpoint error explains itself)
    except BaseException as err:  # (torch.distributed.checkpoint's errors are BaseExceptions)
        rank = int(os.environ.get("RANK", 0))
        if external:  # the rank's log says it (a SLURM task's log, torchrun's output)
            failure.report(err, rank)
        if external and os.environ.get("TORCHELASTIC_ERROR_FILE"):
            failure.write_error_file(os.environ["TORCHELASTIC_ERROR_FILE"], err, rank)
        raise LaunchError(failure.summary(err, rank, failure.write_traceback(err, rank))) \
            from err


def run_on_local_ranks(entry, nproc: int, *args, name: str = "automodel",
                       stop_grace_seconds: int = 30, max_restarts: int = 0) -> dict:
    """Run ``entry(*args)`` on ``nproc`` local ranks (forked from the fork server, under the
    environment of now; torch's elastic launch, a fresh rendezvous port that the OS picks;
    when a rank fails, every rank is stopped and started again up to ``max_restarts`` times,
    each attempt numbered in TORCHELASTIC_RESTART_COUNT). Returns {rank: result}; raises
    ChildFailedError, or SignalException when this process is told to stop (its ranks get
    SIGTERM and ``stop_grace_seconds`` to end)."""
    forkserver.context()  # (its preload list, set before the server first starts)
    run_id = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log.info("starting %d local ranks (rendezvous %s)", nproc, run_id)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=RENDEZVOUS_ENDPOINT, local_addr=RENDEZVOUS_HOST,
        max_restarts=max_restarts,
        monitor_interval=0.1, start_method="forkserver", shutdown_timeout=stop_grace_seconds)
    with _user_signals_stop() as received:
        try:
            return elastic_launch(config, forkserver.run_with_launcher_environment)(
                entry, forkserver.launcher_environment(), *args)
        except SignalException as err:
            err.sigval = received[0] if received else err.sigval
            raise


@contextlib.contextmanager
def _user_signals_stop():
    """SIGUSR1/SIGUSR2 to the launching process stop the run as SIGTERM does (the elastic
    agent turns SIGTERM into a graceful stop of every rank). Yields a list that receives the
    user signal, if one came."""
    received: list = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}

    def to_sigterm(signum, frame):
        received.append(signal.Signals(signum))
        os.kill(os.getpid(), signal.SIGTERM)

    for sig in previous:
        signal.signal(sig, to_sigterm)
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def runs_here(cfg: TrainConfig) -> bool:
    """This process is the job's rank (a SLURM task, a torchrun rank, or a one-process job),
    not the launcher of local ranks."""
    return (cfg.launch.kind == "slurm" or cfg.launch.external
            or cfg.distributed.nproc_per_node == 1)


def launch(cfg: TrainConfig):
    """Run the job; returns rank 0's result (its metric records)."""
    from automodel.models.builder import check_weights

    check_weights(cfg.model)  # (not in the preflight: plan.py takes a config.json alone)
    if cfg.launch.external:  # (not in the preflight: at submit time no srun exists yet)
        why = check_outer_restarts(cfg.distributed.max_restarts, cfg.launch.kind, os.environ)
        if why is not None:
            raise ConfigError(why)
    if runs_here(cfg):
        if cfg.launch.kind == "slurm":  # this srun task is one rank
            from automodel.launch.slurm import export_rank_environment

            export_rank_environment()
            return _run_here(cfg, external=True)
        return _run_here(cfg, cfg.launch.external)  # (TrainingStopped after a stop signal)

    nproc = cfg.distributed.nproc_per_node
    threads = str(rank_threads(os.environ, usable_cpus(), nproc))
    with forkserver.environment_restored(("OMP_NUM_THREADS", THREADS_ENV)):
        os.environ.setdefault("OMP_NUM_THREADS", threads)
        os.environ.setdefault(THREADS_ENV, threads)
        results = _launch_local_ranks(cfg, nproc)
    return results[0]


def _launch_local_ranks(cfg: TrainConfig, nproc: int) -> dict:
    # the ranks' failure summaries come back through a queue, not a file (a full disk must
    # not silence them)
    channel = forkserver.context().SimpleQueue()
    try:
        return run_on_local_ranks(_rank_entry, nproc, cfg, channel,
                                  stop_grace_seconds=cfg.distributed.stop_grace_seconds,
                                  max_restarts=_local_restarts(cfg))
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes <= {128 + s for s in STOP_SIGNALS}:  # the ranks were signalled and saved
            raise _stopped(cfg, min(codes) - 128) from None
        raise LaunchError(_failure_message(err, channel)) from None
    except SignalException as err:  # this process was told to stop; its ranks saved
        raise _stopped(cfg, int(err.sigval)) from None


def _local_restarts(cfg: TrainConfig) -> int:
    """The local launcher's restarts: none where the srun function around it restarts the
    whole step (``automodel.launch.restarts``), so that restarts do not multiply."""
    return 0 if ALLOWED_ENV in os.environ else cfg.distributed.max_restarts


def _stopped(cfg: TrainConfig, signum: int) -> TrainingStopped:
    from automodel.checkpoint.paths import checkpoint_root, complete_checkpoints, step_of

    found = complete_checkpoints(checkpoint_root(cfg.checkpoint.dir, cfg.output_dir))
    return TrainingStopped(signum, step_of(found[-1]) if found else None,
                           found[-1] if found else None)
