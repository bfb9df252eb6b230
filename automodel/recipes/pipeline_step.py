"""One optimizer step under pipeline parallelism: the schedule runs the micro-batches."""

from __future__ import annotations

import torch
import torch.distributed as dist

from automodel.distributed.mesh import MeshAxis
from automodel.distributed.pipelining.stages import PipelineLoss, build_schedule
from automodel.distributed.setup import DistributedSetup
from automodel.recipes.step import count_global_tokens, grad_norm_and_clip


class PipelineStep:
    def __init__(self, parallel, setup: DistributedSetup, per_rank_batch: int):
        p = setup.pipeline
        self.setup = setup
        self.parts = parallel.parts
        self.batch = p.pp_batch_size or per_rank_batch
        self.n_microbatches = self.batch // p.pp_microbatch_size
        self.scale_in_schedule = p.scale_grads_in_schedule
        self.has_first = 0 in parallel.stage_ids
        self.has_last = parallel.num_stages - 1 in parallel.stage_ids
        self.pp_group = setup.mesh[MeshAxis.PP].get_group()
        self.loss = PipelineLoss()
        self.schedule = build_schedule(self.parts, parallel.stage_ids, parallel.num_stages, p,
                                       setup.device, self.pp_group, self.n_microbatches,
                                       self.loss)

    def __call__(self, micro_batches, optimizer, max_grad_norm):
        setup = self.setup
        global_tokens = count_global_tokens(micro_batches, setup)
        self.loss.scale = setup.dp_size / global_tokens * (
            self.n_microbatches if self.scale_in_schedule else 1)
        losses: list = []  # the scaled loss of each micro-batch, on the last stage
        inputs = torch.cat([x for x, _ in micro_batches]).to(setup.device)
        labels = torch.cat([y for _, y in micro_batches]).to(setup.device)
        for chunk in range(0, inputs.shape[0], self.batch):
            args = (inputs[chunk:chunk + self.batch],) if self.has_first else ()
            target = labels[chunk:chunk + self.batch] if self.has_last else None
            chunk_losses: list = []  # the schedule refills this list on every call
            self.schedule.step(*args, target=target,
                               losses=chunk_losses if self.has_last else None)
            losses.extend(chunk_losses)
        params = [p for part in self.parts for p in part.parameters()]
        grad_norm = grad_norm_and_clip(params, max_grad_norm, across_group=self.pp_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(1, dtype=torch.float64, device=setup.device)
        if losses:
            loss_sum += torch.stack([x.detach() for x in losses]).sum().to(torch.float64) \
                / self.loss.scale
        dist.all_reduce(loss_sum, group=self.pp_group)  # only the last stage has it
        if setup.dp_group is not None:
            dist.all_reduce(loss_sum, group=setup.dp_group)
        return float(loss_sum.item()) / global_tokens, grad_norm, global_tokens
