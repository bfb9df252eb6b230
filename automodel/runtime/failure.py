"""What a failed rank reports: where it was (its phase) and the real exception, the root
cause of a chain first. Importable without torch.

Each rank keeps its current phase (``set_phase("checkpoint save")``). When it fails it builds a
one-line summary, prints it to its stderr, and, under the local launcher, sends it to the
launcher by a queue (no file: a full disk must not silence the report). The launcher's
failure message then names every failed rank's summary; a rank that sent none (killed by a
signal, out of memory) is named with its exit code or signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from automodel.errors import describe

_PHASE = ["start-up"]
_CHANNEL: list = [None]  # the launcher's queue, in a locally launched rank
_TRACEBACKS: list = [None]  # the run's folder, where a failed rank writes its traceback


def set_phase(name: str) -> None:
    _PHASE[0] = name


def current_phase() -> str:
    return _PHASE[0]


def summary(exc: BaseException, rank: int | None = None, traceback_file: str | None = None
            ) -> str:
    who = f"rank {rank} " if rank is not None else ""
    where = f" (traceback: {traceback_file})" if traceback_file else ""
    return f"{who}failed during {current_phase()}: {describe(exc)}{where}"


def keep_tracebacks_in(folder: str | None) -> None:
    """Where a failed rank of this process writes its traceback (the run's folder)."""
    _TRACEBACKS[0] = folder


def write_traceback(exc: BaseException, rank: int) -> str | None:
    """``<run folder>/traceback_rank<R>.txt``: the phase and the whole traceback of ``exc``
    (its chain included); the path, or None where no folder is known or it cannot be
    written (a full disk: the summary line stands)."""
    import traceback

    if _TRACEBACKS[0] is None:
        return None
    path = os.path.join(_TRACEBACKS[0], f"traceback_rank{rank}.txt")
    if getattr(exc, "_automodel_traceback", None) == path:
        return path  # (written already: the summary, the error file and the report share it)
    try:
        with open(path, "w") as f:
            f.write(f"rank {rank} failed during {current_phase()}\n\n")
            f.write("".join(traceback.format_exception(exc)))
    except OSError:
        return None
    with contextlib.suppress(AttributeError):
        exc._automodel_traceback = path
    return path


def connect(channel) -> None:
    """In a locally launched rank: where to send the failure summary."""
    _CHANNEL[0] = channel


def report(exc: BaseException, rank: int) -> None:
    """Write this rank's traceback into the run's folder, print its summary to stderr and
    hand it to the launcher, if any."""
    file = write_traceback(exc, rank)
    line = f"automodel: {summary(exc, rank, file)}"
    print(line, file=sys.stderr, flush=True)
    if _CHANNEL[0] is not None:
        where = f" (traceback: {file})" if file else ""
        with contextlib.suppress(Exception):
            _CHANNEL[0].put((rank, current_phase(), describe(exc) + where))


# What a rank reports when a peer died first: its own failure is a consequence.
_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "remote worker crashing", "Timed out waiting")


def is_consequence(description: str) -> bool:
    """Whether a rank's failure only says that another rank went away first."""
    return any(c in description for c in _CONSEQUENCES)


# How long a rank whose failure is only a peer's (connection closed) waits before it exits.
CONSEQUENCE_GRACE_S = 2.0


def let_the_cause_exit_first(exc: BaseException) -> None:
    """A rank that failed only because a peer went away waits a moment before exiting: the
    elastic agent names the first exit it sees (and stops the rest), and on a loaded machine
    this rank could reach its exit before the killed peer's death was seen, leaving the job's
    message without the rank that caused it."""
    if is_consequence(describe(exc)):
        import time

        time.sleep(CONSEQUENCE_GRACE_S)


def write_error_file(path: str, exc: BaseException, rank: int) -> None:
    """The error file a torch elastic agent (torchrun) reads for its failure summary: our
    summary first, then the traceback."""
    import json
    import time
    import traceback

    text = f"automodel: {summary(exc, rank, write_traceback(exc, rank))}"
    stack = "".join(traceback.format_exception(exc))
    with contextlib.suppress(OSError):  # (a full disk: the stderr line stands)
        with open(path, "w") as f:
            json.dump({"message": {"message": text, "extraInfo": {
                "py_callstack": f"{text}\n\n{stack}", "timestamp": str(int(time.time()))}}}, f)


def launcher_message(failures: dict, reports: dict) -> str:
    """The launcher's failure message: ``failures`` {rank: (exit code, error file text)} from
    torch elastic, ``reports`` {rank: (phase, description)} from the ranks. A rank that
    reported its failure but was stopped by the agent before its own exit counted (a peer's
    exit came first: torch then names the peer only) is named too, without an exit code."""
    lines = []
    # who failed first: ranks with a report of their own cause, then ranks that ended without
    # one (killed), then those whose failure follows from a peer's, then those the agent
    # stopped after the first failure
    def first(rank):
        if rank in reports:
            return 2 if is_consequence(reports[rank][1]) else 0
        code = failures[rank][0]
        return 3 if isinstance(code, int) and -code in (signal.SIGTERM, signal.SIGINT) else 1

    order = sorted(set(failures) | set(reports), key=lambda r: (first(r), r))
    for rank in order:
        code, detail = failures.get(rank, (None, None))
        head = f"rank {rank} failed" + (f" (exit code {code})" if rank in failures else "")
        if rank in reports:
            where, what = reports[rank]
            lines.append(f"{head} during {where}: {what}")
            continue
        if detail and not str(detail).startswith("To enable traceback"):
            lines.append(f"{head}: {detail}")
            continue
        if isinstance(code, int) and code < 0:
            with contextlib.suppress(ValueError):
                name = signal.Signals(-code).name
                if reports and -code in (signal.SIGTERM, signal.SIGINT):
                    lines.append(f"{head}: stopped by {name} after rank {min(reports)} failed")
                else:
                    lines.append(f"{head}: killed by {name}, with no error report (out of "
                                 "memory, or stopped from outside?)")
                continue
        lines.append(f"{head}: no error report (its log above has what it printed)")
    return "\n".join(lines)
