"""Errors of checkpoints (no torch here: the CLI catches them before torch is imported)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated or from another model."""
