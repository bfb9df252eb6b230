"""Build the next steps' micro-batches in a background thread while the current step runs.

Which rows a rank reads at a step is a function of the step alone (``data/batches.py``), so
reading ahead changes nothing about the tokens each rank sees: it only moves the reading (of
memory-mapped rows, image files) and the pinning of host memory for a fast copy to the
accelerator off the training step's path.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch


def pin(micro_batches: list) -> list:
    """The micro-batches with their tensors in pinned host memory (copies to an accelerator
    then run without waiting)."""
    def pinned(x):
        return x.pin_memory() if isinstance(x, torch.Tensor) else x

    out = []
    for mb in micro_batches:
        head = [pinned(x) for x in mb[:2]]
        extras = [{k: pinned(v) for k, v in mb[2].items()}] if len(mb) > 2 else []
        out.append((*head, *extras))
    return out


class Prefetcher:
    """``get(step)`` for steps in increasing order returns ``make(step)``, built ``depth``
    steps ahead (never past step ``end - 1``) in one worker thread (``depth`` 0: built when
    asked)."""

    def __init__(self, make: Callable[[int], list], depth: int, end: int, pin_memory: bool):
        self.make = (lambda step: pin(make(step))) if pin_memory else make
        self.depth, self.end = depth, end
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") \
            if depth > 0 else None
        self.ahead: dict[int, Future] = {}

    def get(self, step: int) -> list:
        if self.pool is None:
            return self.make(step)
        for s in range(step, max(min(step + self.depth + 1, self.end), step + 1)):
            if s not in self.ahead:
                self.ahead[s] = self.pool.submit(self.make, s)
        for s in [s for s in self.ahead if s < step]:
            self.ahead.pop(s).cancel()
        return self.ahead.pop(step).result()

    def close(self) -> None:
        if self.pool is not None:
            for future in self.ahead.values():
                future.cancel()
            self.pool.shutdown(wait=True)
