"""Launch errors, importable without torch."""


class LaunchError(RuntimeError):
    """A rank failed; the message names it."""
