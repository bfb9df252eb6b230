"""Saves that do not stop training (``checkpoint.async_mode=thread|process``).

A save copies the state into host memory (staging: training waits for it, so no later update
lands in what is written) and returns. The write goes on in the background: in a thread of
each rank, or in a process of each rank (``process``: the copy in shared memory, the write
free of the training process's interpreter lock). Its collectives run on a gloo group of the
model's ranks made once for them (a background collective must not share the training's
group). Then, still in the background, every rank learns whether every rank's write
succeeded, and the checkpoint is completed as a blocking save completes it (``trainer.json``,
the Hugging Face export, written by one rank per host, then rank 0's atomic rename and
``keep_last``): a checkpoint is visible, to ``resume=auto`` too, only once every byte of it
is written. Its group keeps ``checkpoint.save_timeout_minutes`` for the whole write.

One save is in flight at a time: a save due while the last one is writing waits for it, and
says so. A failed write is kept and raised by the training thread at its next step boundary
(``raise_if_failed``) on every rank, naming the cause; the last complete checkpoint stays.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from automodel.checkpoint.manager import _gather
from automodel.compat import stop_checkpoint_writer
from automodel.config.enums import AsyncMode
from automodel.errors import CheckpointWriteError, describe

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    step: int
    path: str  # where the checkpoint appears once complete
    started: float  # time.monotonic() when the save began
    done: Future  # the background completion: None, or the error text of a failed save


class BackgroundSaver:
    """The background half of ``Checkpointer.save`` under ``checkpoint.async_mode``."""

    def __init__(self, mode: AsyncMode, group, rank: int, pinned_memory: bool = False):
        self.mode = mode
        self.group = group  # gloo, the model's ranks (None: a lone process)
        self.rank = rank
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=pinned_memory, use_shared_memory=mode == AsyncMode.process,
            use_async_staging=False, use_non_blocking_copy=False))
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-save")
        self.in_flight: InFlight | None = None
        self.failure: str | None = None

    def wait(self, reason: str = "") -> None:
        """Block until the save in flight (if any) is complete; keep its failure."""
        if self.in_flight is None:
            return
        if not self.in_flight.done.done() and reason:
            log.info("checkpoint of step %d still being written: %s waits for it",
                     self.in_flight.step, reason)
        self._settle(self.in_flight.done.result())

    def start(self, step: int, path: str, state: dict, tmp: str, finish: Callable[[], None],
              faults=None) -> None:
        """Stage ``state`` (blocking: a copy in host memory) and write the copy to ``tmp`` in
        the background; then every rank's outcome is shared and ``finish`` runs (rank 0
        completes and publishes the checkpoint)."""
        staged = self.stager.stage(state)
        done = self.executor.submit(self._write, step, staged, tmp, finish, faults)
        self.in_flight = InFlight(step, path, time.monotonic(), done)

    def _write(self, step: int, staged: dict, tmp: str, finish: Callable[[], None],
               faults) -> str | None:
        error = None
        try:
            if faults is not None:
                faults.before_background_write()
            if self.mode == AsyncMode.process:  # (the copy is in shared memory already)
                dcp.async_save(staged, checkpoint_id=tmp, process_group=self.group,
                               async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                               async_stager=_AlreadyStaged(),
                               no_dist=not dist.is_initialized()).result()
            else:
                dcp.save(staged, checkpoint_id=tmp, process_group=self.group,
                         no_dist=not dist.is_initialized())
            if faults is not None:
                faults.in_save(step)
        except BaseException as err:  # (reported to every rank, raised by training)
            error = f"rank {self.rank}: {describe(err)}"
        try:
            errors = [e for e in _gather(error, self.group) if e]
        except BaseException as err:  # (the group broke: a write timed out, a rank died)
            return error or f"rank {self.rank}: {describe(err)}"
        if errors:
            return "; ".join(errors)
        try:
            finish()
        except BaseException as err:
            return f"rank {self.rank}: {describe(err)}"
        return None

    def poll(self) -> None:
        """At a step boundary: note a finished save (log it), keep a failure."""
        if self.in_flight is not None and self.in_flight.done.done():
            self._settle(self.in_flight.done.result())

    def _settle(self, error: str | None) -> None:
        flight, self.in_flight = self.in_flight, None
        if error is not None:
            self.failure = (f"the background save of step {flight.step}'s checkpoint "
                            f"({flight.path}) failed: {error}")
        elif self.rank == 0:
            log.info("checkpoint written: %s (%.2f s after its save began)", flight.path,
                     time.monotonic() - flight.started)

    def raise_if_failed(self) -> None:
        self.poll()
        if self.failure is not None:
            raise CheckpointWriteError(f"{self.failure}; the last complete checkpoint is "
                                       "kept, resume from it with checkpoint.resume=auto")

    def close(self) -> None:
        """Wait for the save in flight, then free the stager's memory, the thread and (process
        mode) DCP's writer process."""
        try:
            self.wait("the end of the run")
        finally:
            self.stager.close()
            self.executor.shutdown(wait=True)
            if self.mode == AsyncMode.process:  # (DCP's writer process, its group and port)
                stop_checkpoint_writer()


class _AlreadyStaged(AsyncStager):
    """The state handed to DCP's process writer is the stager's copy already."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass
