"""Where checkpoints live and which are complete (no torch needed: used at config time)."""

from __future__ import annotations

import os
import re

_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_root(directory: str | None, output_dir: str) -> str:
    """``checkpoint.dir``, or ``<output dir>/checkpoints`` when it is null."""
    return directory or os.path.join(output_dir, "checkpoints")


def checkpoint_path(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def step_of(path: str) -> int:
    return int(_NAME.match(os.path.basename(path)).group(1))


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest first (a save that never
    finished is a ``.tmp-`` directory, or has no ``trainer.json``)."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _NAME.match(n)
                   and os.path.isfile(os.path.join(root, n, "trainer.json")))
    return [os.path.join(root, n) for n in names]
