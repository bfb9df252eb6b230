"""Evaluation on the held-out rows (``trainer.eval_every``): the mean token loss over them,
forward only, in whatever layout trains.

The held-out rows are read in order (no shuffle), in global batches split over the
data-parallel ranks as in training, so every layout sees the same tokens and reports the same
``eval_loss``. The loss is the training loss (``automodel/loss.py``) summed over the tokens
of all batches and divided by their number; the pipeline's last stage computes it there.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from automodel.data.batches import IGNORE_INDEX, BatchPlan
from automodel.distributed.setup import DistributedSetup
from automodel.recipes.pipeline_step import step_loader_options
from automodel.recipes.step import device_batches, forward_loss


class Evaluator:
    def __init__(self, rows, trainer, setup: DistributedSetup, pipeline=None, head_loss=None):
        self.trainer, self.setup, self.pipeline = trainer, setup, pipeline
        self.head_loss = head_loss
        self.plan = BatchPlan(rows, trainer.global_batch_size, trainer.seed, shuffle=False,
                              what="the held-out data (data.eval_fraction or data.eval_split)")
        self.batches = min(self.plan.batches_per_epoch, trainer.eval_batches or math.inf)

    def due(self, number: int) -> bool:
        """After step ``number``: every ``trainer.eval_every`` steps, and after the last."""
        every = self.trainer.eval_every
        return bool(every) and (number % every == 0 or number == self.trainer.max_steps)

    @torch.no_grad()
    def __call__(self, parts: list) -> float:
        setup = self.setup
        for part in parts:
            part.eval()
        try:
            sums = torch.zeros(2, dtype=torch.float64, device=setup.device)  # [loss, tokens]
            for index in range(int(self.batches)):
                micro = self.plan.micro_batches(
                    index, setup.dp_rank, setup.dp_size,
                    **step_loader_options(self.pipeline, self.trainer.local_batch_size))
                if self.pipeline is not None:
                    sums += self.pipeline.evaluate(micro)
                    continue
                for batch in device_batches(micro, setup):
                    _, loss = forward_loss(parts[0], setup, batch, head_loss=self.head_loss)
                    sums[0] += loss.to(torch.float64)
                    sums[1] += (batch[1] != IGNORE_INDEX).sum()
            if setup.loss_group is not None:
                dist.all_reduce(sums, group=setup.loss_group)
            loss, tokens = sums.tolist()  # (one host read per evaluation)
        finally:
            for part in parts:
                part.train()
        return loss / tokens
