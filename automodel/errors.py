"""The error types every layer shares, and how a failure's cause is read from its chain.

The lowest module of the package: it imports nothing of automodel, and no torch, so the
configuration (``config/``), the runtime (``checkpoint/``, ``data/``, ``tracking/``,
``recipes/``) and the launchers (``launch/``, ``cli.py``) can all import it.
``ConfigError`` (a user error in the configuration) lives with the configuration,
``automodel/config/build.py``, which is as low and as torch-free.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the composed configuration (raised before any process starts)."""


class Explained(Exception):
    """An error whose message already says what happened, where, and what to do."""


class FileWriteError(Explained, OSError):
    """A file of the run could not be written; the message names it and the cause."""


class CheckpointError(Explained, ValueError):
    """A checkpoint that cannot be used: missing, truncated or from another model."""


class CheckpointWriteError(Explained, OSError):
    """A checkpoint could not be written (a full disk, a read-only file system): the message
    names the path, the cause, and the last complete checkpoint to resume from."""


class LaunchError(RuntimeError):
    """A rank failed; the message names it."""


class TrainingStopped(Exception):
    """A stop signal (SIGTERM, SIGUSR1, SIGUSR2) ended the run early after a checkpoint."""

    def __init__(self, signum: int, step: int | None, checkpoint: str | None):
        super().__init__(signum, step, checkpoint)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        import signal

        after = f" after step {self.step}" if self.step is not None else ""
        saved = (f"checkpoint saved: {self.checkpoint}" if self.checkpoint else
                 "no checkpoint was written")
        return (f"stopped by {signal.Signals(self.signum).name}{after}; {saved}. To continue, "
                "run again with checkpoint.resume=auto (a requeued SLURM job does so itself)")


# ------------------------------------------------------------------ reading a failure's cause
def causes(exc: BaseException):
    """``exc`` and the exceptions it was raised from, outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's wrapper:
        if isinstance(failures, dict) and failures:  # {rank: (exception, traceback)}
            inner = next(iter(failures.values()))
            inner = inner[0] if isinstance(inner, tuple) and inner else inner
            exc = inner if isinstance(inner, BaseException) else None
            continue
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def describe(exc: BaseException) -> str:
    """``Type: message`` of the root cause, and of the exception that carried it when that is
    another one (``OSError: [Errno 28] ... (raised as RuntimeError: ...)``). An automodel
    error that explains the cause itself (``Explained``) is given as it is."""
    chain = list(causes(exc))
    if isinstance(exc, Explained):
        return f"{type(exc).__name__}: {exc}"
    root = chain[-1]
    text = f"{type(root).__name__}: {_first_line(root) or '(no message)'}"
    if root is not exc:
        text += f" (raised as {type(exc).__name__}: {_first_line(exc)[:200]})"
    return text


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` or what it was raised from is a full disk (ENOSPC, or its message)."""
    import errno

    return any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
               or "No space left on device" in str(e) for e in causes(exc))


def os_error(exc: BaseException) -> OSError | None:
    """The first ``OSError`` in ``exc``'s chain (None: not a file-system failure)."""
    return next((e for e in causes(exc) if isinstance(e, OSError)), None)


def size(n: float) -> str:
    """Bytes for a message: ``1.50 GiB``, ``37.2 MiB``."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
