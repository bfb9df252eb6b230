"""One optimizer step under pipeline parallelism: the schedule runs the micro-batches."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from automodel.distributed.mesh import MeshAxis
from automodel.distributed.pipelining.buffer_pool import (
    install_recv_buffer_pool,
    recv_buffer_bytes,
    ring_size,
)
from automodel.distributed.pipelining.layout import canonical_schedule
from automodel.distributed.pipelining.stages import PipelineLoss, build_schedule, load_loss_fn
from automodel.distributed.pipelining.tied import TiedEmbeddingSync
from automodel.distributed.setup import DistributedSetup
from automodel.recipes.step import count_global_tokens, grad_norm_and_clip

log = logging.getLogger(__name__)


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
        self.tied = (TiedEmbeddingSync(self.parts, parallel.stage_ids, parallel.num_stages,
                                       setup.mesh, setup.dist.timeout)
                     if parallel.tied_embeddings else None)
        self.loss = PipelineLoss(load_loss_fn(p.loss_fn))
        shapes = (p.pp_seq_len, self._activation_dtype()) if p.pp_seq_len else None
        if setup.autocast_dtype is not None:
            for part in self.parts:
                _forward_under_autocast(part, setup.device.type, setup.autocast_dtype)
        self.schedule = build_schedule(self.parts, parallel.stage_ids, parallel.num_stages, p,
                                       setup.device, self.pp_group, self.n_microbatches,
                                       self.loss, shapes)
        if p.pp_recv_buffer_pool:
            self._pool_receive_buffers(parallel.num_stages)
        self._defer_reduce = False
        if p.patch_stage_backward_maybe_with_nosync:
            for stage in _stages_of(self.schedule):
                _defer_fsdp_reduce(stage, self)

    def _pool_receive_buffers(self, num_stages: int) -> None:
        p = self.setup.pipeline
        if p.pp_schedule_csv is not None or canonical_schedule(p.pp_schedule) != "1f1b":
            log.warning("pipeline.pp_recv_buffer_pool applies to the 1f1b schedule only; "
                        "ignored for %s", p.pp_schedule_csv or p.pp_schedule)
            return
        for stage in _stages_of(self.schedule):
            install_recv_buffer_pool(stage, ring_size(num_stages, stage.stage_index,
                                                      self.n_microbatches,
                                                      p.pp_recv_buffer_pool_slack))

    def recv_buffer_bytes(self) -> int:
        """Receive-buffer bytes of the whole pipeline (all stages, summed over pp ranks)."""
        t = torch.tensor([float(sum(recv_buffer_bytes(s) for s in _stages_of(self.schedule)))],
                         dtype=torch.float64, device=self.setup.device)
        dist.all_reduce(t, group=self.pp_group)
        return int(t.item())

    def _activation_dtype(self) -> torch.dtype:
        """What flows between stages: pipeline.dtype, else FSDP2's parameter dtype, else the
        model's."""
        p, setup = self.setup.pipeline, self.setup
        if p.dtype is not None:
            return getattr(torch, p.dtype)
        if setup.strategy == "fsdp2" and setup.mp_policy is not None:
            name = setup.mp_policy.kwargs.get("param_dtype")
            if name is not None:
                return getattr(torch, name)
        return next(self.parts[0].parameters()).dtype

    def __call__(self, micro_batches, max_grad_norm):
        """The schedule over the micro-batches, then clip (the optimizer step is the
        caller's). Returns (global mean loss, gradient norm, global token count)."""
        setup = self.setup
        global_tokens = count_global_tokens(micro_batches, setup)
        self.loss.scale = setup.dp_size / global_tokens * (
            self.n_microbatches if self.scale_in_schedule else 1)
        losses: list = []  # the scaled loss of each micro-batch, on the last stage
        inputs = torch.cat([x for x, _ in micro_batches]).to(setup.device)
        labels = torch.cat([y for _, y in micro_batches]).to(setup.device)
        chunks = range(0, inputs.shape[0], self.batch)
        for chunk in chunks:
            # with the no-sync patch, gradients are reduced after the last chunk only
            self._defer_reduce = chunk != chunks[-1]
            args = (inputs[chunk:chunk + self.batch],) if self.has_first else ()
            target = labels[chunk:chunk + self.batch] if self.has_last else None
            chunk_losses: list = []  # the schedule refills this list on every call
            self.schedule.step(*args, target=target,
                               losses=chunk_losses if self.has_last else None)
            losses.extend(chunk_losses)
        not_in_norm = frozenset()
        if self.tied is not None:
            self.tied.sync_grads()
            not_in_norm = frozenset(self.tied.not_in_norm)
        params = [p for part in self.parts for p in part.parameters()]
        grad_norm = grad_norm_and_clip(params, max_grad_norm, across_group=self.pp_group,
                                       not_in_norm=not_in_norm)
        loss_sum = torch.zeros(1, dtype=torch.float64, device=setup.device)
        if losses:
            loss_sum += torch.stack([x.detach() for x in losses]).sum().to(torch.float64) \
                / self.loss.scale
        dist.all_reduce(loss_sum, group=self.pp_group)  # only the last stage has it
        if setup.dp_group is not None:
            dist.all_reduce(loss_sum, group=setup.dp_group)
        return float(loss_sum.item()) / global_tokens, grad_norm, global_tokens


def _forward_under_autocast(part, device_type: str, dtype: torch.dtype) -> None:
    forward = part.forward

    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    part.forward = autocast_forward


def _stages_of(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _defer_fsdp_reduce(stage, step: PipelineStep) -> None:
    """pipeline.patch_stage_backward_maybe_with_nosync: when one optimizer step runs several
    schedule steps (pp_batch_size < the per-rank batch), keep FSDP's gradients unreduced
    until the last one instead of reduce-scattering after each."""
    reduce = stage.perform_reduce_grad

    def maybe_reduce(grad_scale_factor):
        if not step._defer_reduce:
            reduce(grad_scale_factor)

    stage.perform_reduce_grad = maybe_reduce
