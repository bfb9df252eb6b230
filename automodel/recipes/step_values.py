"""The one device-to-host transfer of a training step.

A step leaves its results on the device (``StepStats``); the runner needs them on the host to
apply ``trainer.on_nonfinite``, to log, and to know whether a stop signal reached any rank. On a
GPU each host read waits until the device has caught up, so everything is read together, once
per step, after clipping and before the optimizer step (which must not run for a non-finite
step):

- loss, gradient norm and token count: global already (the step sums the loss and the tokens
  over the data-parallel and pipeline ranks; clipping makes the norm global);
- the stop signal, the peak memory and the peak of live tensor bytes of every rank: one small
  all-gather of ``[signal, peak bytes, peak tensor bytes]`` over the model's ranks, issued on
  the device and not read by itself; the host takes the largest signal and peak, and keeps
  the tensor peaks rank by rank. It cannot join the step's sums: another group (the model's
  group ``DistributedSetup.process_group``, not the data-parallel ranks, which under TP or PP
  is a subgroup; nor the world, where other ranks may hold another model);
- the step's extras (the pipeline's receive-buffer bytes).

All of it is stacked into one float64 tensor (exact for integers below 2**53) and read with one
``.tolist()``. Every rank reads the same values, so every rank takes the same branches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from automodel.distributed.init import DistInfo
from automodel.recipes.step import StepStats, full
from automodel.recipes.step_log import local_peak_memory_bytes
from automodel.tracking.memory import TensorPeak


@dataclass(frozen=True)
class StepValues:
    """A step's values on the host, the same on every rank."""

    loss: float
    grad_norm: float
    tokens: int
    stop_signal: int | None  # the signal any rank received, else None
    peak_memory_bytes: int  # the largest peak so far over all ranks
    extra: dict = field(default_factory=dict)
    # each rank's peak of live tensor bytes since the last step's read, by the model's rank
    # (None: not counted, trainer.track_tensor_memory)
    peak_tensor_bytes_by_rank: Optional[list] = None

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def read_step(stats: StepStats, info: DistInfo, stop_signal: int | None,
              group=None, tensor_peak: Optional[TensorPeak] = None) -> StepValues:
    """The step's one read: ``stats`` and, over the ranks of ``group`` (the model's; None:
    this process alone), the largest of this rank's ``stop_signal`` (None or 0: none
    received) and peak memory, and each rank's peak of live tensor bytes (``tensor_peak``,
    read here: its next window starts)."""
    device = stats.loss.device
    tensors = tensor_peak.read() if tensor_peak is not None else None
    mine = torch.stack([full(stop_signal or 0, device),
                        full(local_peak_memory_bytes(info, tensor_peak), device),
                        full(-1 if tensors is None else tensors, device)])
    size = dist.get_world_size(group) if group is not None else 1
    ranks = mine
    if size > 1:  # (labelled: bookkeeping, not the training step's communication)
        ranks = torch.empty(3 * size, dtype=mine.dtype, device=device)
        with record_function("automodel::read"):
            dist.all_gather_single(ranks, mine, group=group)
    extra = stats.extra or {}
    values = torch.cat([
        torch.stack([stats.loss.to(torch.float64), stats.grad_norm.to(torch.float64),
                     stats.tokens.to(torch.float64)]),
        ranks,
        *[t.to(torch.float64).reshape(1) for t in extra.values()],
    ]).tolist()  # the one device-to-host transfer of the step
    loss, grad_norm, tokens = values[:3]
    per_rank, rest = values[3:3 + 3 * size], values[3 + 3 * size:]
    by_rank = None if tensors is None else [int(v) for v in per_rank[2::3]]
    return StepValues(loss, grad_norm, int(tokens), int(max(per_rank[0::3])) or None,
                      int(max(per_rank[1::3])),
                      {name: (v if t.is_floating_point() else int(v))
                       for (name, t), v in zip(extra.items(), rest)}, by_rank)
