"""Rank 0's progress display: a live bar on a terminal, plain log lines otherwise.

On a terminal a tqdm bar shows the step, loss, tokens/s, peak memory and the ETA, and log
lines are printed above it. When output is not a terminal (a file, a pipe, a SLURM log) there
is no bar: the log lines every ``trainer.log_every`` steps carry the same numbers.
"""

from __future__ import annotations

import contextlib
import shutil
import sys


class Progress:
    def __init__(self, total_steps: int, enabled: bool, stream=None, initial: int = 0):
        self.stream = stream or sys.stderr
        self.bar = None
        self.eval_loss: float | None = None  # shown from the first evaluation on
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            # a terminal that reports no size (a bare pseudo-terminal) still gets a bar:
            # tqdm hides bars below a screen of 0 rows
            size = shutil.get_terminal_size((100, 20))
            self.bar = tqdm(total=total_steps, unit="step", ncols=size.columns or 100,
                            nrows=size.lines or 20, file=self.stream, desc="train", leave=True,
                            initial=initial)

    def logging_redirect(self):
        """Print log records above the bar instead of through it."""
        if self.bar is None:
            return contextlib.nullcontext()
        from tqdm.contrib.logging import logging_redirect_tqdm

        return logging_redirect_tqdm(tqdm_class=type(self.bar))

    def update(self, loss: float, tokens_per_second: float, peak_memory_bytes: int | None,
               eval_loss: float | None = None) -> None:
        if self.bar is None:
            return
        if eval_loss is not None:
            self.eval_loss = eval_loss
        postfix = {"loss": f"{loss:.4f}", "tok/s": f"{tokens_per_second:.0f}"}
        if self.eval_loss is not None:
            postfix["eval"] = f"{self.eval_loss:.4f}"
        if peak_memory_bytes is not None:
            postfix["mem"] = f"{peak_memory_bytes / 2**20:.0f}MiB"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
