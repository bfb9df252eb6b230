"""Fault injection for tests and failure drills, read from ``AUTOMODEL_FAULTS`` (never from
the training config, so a real run cannot switch it on by accident).

``AUTOMODEL_FAULTS`` is a comma-separated list of ``kind@step[:rank][/restart]`` (rank omitted:
every rank; restart omitted: every run of the job, else only the run after that many SLURM
requeues and in-job restarts (``distributed.max_restarts``) together, ``/0`` being the first
run); a step is the 1-based number of the optimizer step:

    nan@3            step 3's logits become NaN (so its loss and gradients do)
    kill@3:1         rank 1 kills itself with SIGKILL at the start of step 3
    kill_in_save@4:0 rank 0 kills itself inside the save of step 4's checkpoint, after the
                     shards are written and before the checkpoint is made complete
    sleep@0.2        every step sleeps 0.2 s on every rank (keeps a short run alive long
                     enough to signal it)
    kill@3:2/0       rank 2 kills itself at the start of step 3 in the job's first run only
                     (a requeued job then runs through)
    raise@3:1        rank 1 raises at the start of step 3 a RuntimeError chained from a
                     ValueError (the root cause a failure summary must name)
    enospc_in_save@4 the save of step 4's checkpoint fails as a full disk does: an
                     OSError(ENOSPC) inside the writer, re-raised as a RuntimeError (for file
                     systems a test cannot fill)
    slow_save@1.5    every background save (checkpoint.async_mode) waits 1.5 s before it
                     writes: training goes on meanwhile (a window for a test to observe)

Everything injected runs through the real code path (real NaNs, real SIGKILL).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ENV = "AUTOMODEL_FAULTS"
KINDS = ("nan", "kill", "kill_in_save", "sleep", "raise", "enospc_in_save", "slow_save")


@dataclass(frozen=True)
class Fault:
    kind: str
    value: float  # the step (or the seconds of ``sleep``)
    rank: int | None
    restart: int | None = None  # only in this run of a requeued SLURM job


def parse(text: str | None) -> list[Fault]:
    faults = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind, _, rest = item.partition("@")
        rest, _, restart = rest.partition("/")
        where, _, rank = rest.partition(":")
        try:
            if kind not in KINDS:
                raise ValueError(kind)
            faults.append(Fault(kind, float(where), int(rank) if rank else None,
                                int(restart) if restart else None))
        except ValueError:
            raise ValueError(f"{ENV}={text!r}: cannot read {item!r}; expected "
                             f"kind@step[:rank][/restart] with kind one of {', '.join(KINDS)}"
                             ) from None
    return faults


class Faults:
    def __init__(self, rank: int, text: str | None = None, restart: int | None = None):
        self.rank = rank
        if restart is None:  # (the attempt: SLURM's requeues plus the in-job restarts)
            from automodel.runtime.attempts import in_job_restart

            restart = int(os.environ.get("SLURM_RESTART_COUNT", 0)) + in_job_restart()
        self.faults = [f for f in parse(os.environ.get(ENV) if text is None else text)
                       if f.rank in (None, rank) and f.restart in (None, restart)]

    def _at(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and int(f.value) == step for f in self.faults)

    def before_step(self, step: int) -> None:
        """Called at the start of 1-based ``step``."""
        for f in self.faults:
            if f.kind == "sleep":
                time.sleep(f.value)
        if self._at("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._at("raise", step):
            try:
                raise ValueError(f"injected root cause at step {step}")
            except ValueError as cause:
                raise RuntimeError("injected wrapper") from cause

    def poison_logits(self, step: int, modules) -> list:
        """Hooks that turn the logits of ``step`` into NaN; remove them after the step."""
        if not self._at("nan", step):
            return []
        return [m.register_forward_hook(_nan_output) for m in modules]

    def before_background_write(self) -> None:
        for f in self.faults:
            if f.kind == "slow_save":
                time.sleep(f.value)

    def in_save(self, step: int) -> None:
        if self._at("kill_in_save", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._at("enospc_in_save", step):
            import errno

            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as cause:
                raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter "
                                   "failed writing file data") from cause


def _nan_output(module, args, output):
    if hasattr(output, "logits"):
        output.logits = output.logits * float("nan")
        return output
    return output * float("nan")
