"""Errors of checkpoints (no torch here: the CLI catches them before torch is imported)."""

from automodel.launch.failure import Explained


class CheckpointError(Explained, ValueError):
    """A checkpoint that cannot be used: missing, truncated or from another model."""


class CheckpointWriteError(Explained, OSError):
    """A checkpoint could not be written (a full disk, a read-only file system): the message
    names the path, the cause, and the last complete checkpoint to resume from."""
