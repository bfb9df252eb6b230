"""Graceful stop: on SIGTERM, SIGUSR1 or SIGUSR2 a rank finishes its current step, the job
saves a checkpoint and ends.

The handler only records the signal (``StopSignal.received``); each step's one read of device
values (``recipes/step_values.read_step``) carries it as a maximum over the model's ranks (its
process group: other ranks of the job may hold another model), so a signal
that reached some ranks only still stops all of them after the same step (the step it arrived
in, or the next when it came after that step's read). Under SLURM the handler that
submitit installed for its preemption signal is kept and called once the checkpoint is
written: it requeues the job (submitit's checkpoint/requeue), and the requeued job resumes
from that checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading

from automodel.runtime.attempts import under_srun_function

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopSignal:
    def __init__(self):
        self.received: int | None = None
        self.previous: dict = {}

    def install(self) -> "StopSignal":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals can only be handled on the main thread
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers found at install (kept in ``previous``). A rank that stopped
        under the srun function of in-job restarts ignores stop signals from here to its exit
        instead: once one rank of the step has exited with its stop code, srun terminates the
        others (``--kill-on-bad-exit``), and a rank killed by that SIGTERM would end with 143,
        which the function takes for a failure and restarts (``launch/restarts.py``)."""
        if threading.current_thread() is not threading.main_thread():
            return
        stopping = self.received is not None and under_srun_function()
        for sig, handler in self.previous.items():
            if stopping:
                handler = signal.SIG_IGN
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            log.warning("received %s: finishing the current step, then saving a checkpoint",
                        signal.Signals(signum).name)

    def hand_over_to_submitit(self) -> bool:
        """Under submitit, run its preemption handler (checkpoint callable, requeue, exit).
        Returns False when there is none."""
        try:
            from submitit.core.job_environment import JobEnvironment
        except ImportError:
            return False
        sig = JobEnvironment._usr_sig()
        handler = self.previous.get(sig)
        if not callable(handler) or "submitit" not in getattr(handler, "__module__", ""):
            return False
        try:
            handler(sig, None)  # rank 0: checkpoint callable, requeue, sys.exit
        except SystemExit:
            pass  # the caller ends the rank, after the other ranks know
        except Exception as err:  # e.g. requeued too many times
            log.error("submitit did not requeue the job: %s", err)
            return False
        return True
