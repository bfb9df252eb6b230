"""One optimizer step under pipeline parallelism: the schedule runs the micro-batches.

Like ``recipes/step.py``, nothing is read on the host: the step returns device tensors."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from automodel.compat import defer_reduce_grad, stages_of
from automodel.data.batches import IGNORE_INDEX
from automodel.distributed.mesh import MeshAxis
from automodel.distributed.pipelining.buffer_pool import pool_schedule, recv_buffer_bytes
from automodel.distributed.pipelining.schedule import stages_by_rank
from automodel.distributed.pipelining.stage_images import ROWS, schedule_inputs
from automodel.distributed.pipelining.stages import PipelineLoss, build_schedule, load_loss_fn
from automodel.distributed.pipelining.tied import TiedEmbeddingSync
from automodel.distributed.setup import DistributedSetup
from automodel.models.multimodal import IMAGE_TOKEN_MASKS, is_image_text
from automodel.recipes.router_loss import RouterLoss, carry_routing_sums
from automodel.recipes.step import (
    StepStats,
    count_global_tokens,
    full,
    grad_norm_and_clip,
    known_packing,
    sequence_shard,
    to_device,
)

log = logging.getLogger(__name__)


class PipelineStep:
    def __init__(self, parallel, setup: DistributedSetup, per_rank_batch: int,
                 router_loss: RouterLoss | None = None):
        p = setup.pipeline
        self.setup = setup
        self.parts = parallel.parts
        self.batch = p.pp_batch_size or per_rank_batch
        self.n_microbatches = self.batch // p.pp_microbatch_size
        self.scale_in_schedule = p.scale_grads_in_schedule
        self.has_first = 0 in parallel.stage_ids
        self.images = is_image_text(self.parts[0].config)  # (``stage_images.py``)
        self.has_last = parallel.num_stages - 1 in parallel.stage_ids
        self.pp_group = setup.mesh[MeshAxis.PP].get_group()
        holders = stages_by_rank(p, setup.size(MeshAxis.PP), parallel.num_stages)
        self.tied = (TiedEmbeddingSync(self.parts, parallel.stage_ids, holders, setup.mesh,
                                       setup.dist.timeout)
                     if parallel.tied_embeddings else None)
        self.loss = PipelineLoss(parallel.head_loss or load_loss_fn(p.loss_fn), router_loss,
                                 setup.cp.cp_group if setup.cp is not None else None)
        self.aux_sums: list = []
        if router_loss is not None:
            carry_routing_sums(self.parts, router_loss)
        # static stage shapes: this rank's share of the sequence under context parallelism;
        # under sequence parallelism stages pass each TP rank's share of that
        seq_shards = (setup.size(MeshAxis.TP)
                      if getattr(setup.options, "sequence_parallel", False) else 1)
        shapes = ((setup.layout.local_seq_len(p.pp_seq_len), self._activation_dtype(),
                   seq_shards) if p.pp_seq_len else None)
        if setup.autocast_dtype is not None:
            for part in self.parts:
                _forward_under_autocast(part, setup.device.type, setup.autocast_dtype)
        self.schedule = build_schedule(self.parts, parallel.stage_ids, parallel.num_stages, p,
                                       setup.device, self.pp_group, self.n_microbatches,
                                       self.loss, shapes,
                                       fused_head=parallel.head_loss is not None)
        if p.pp_recv_buffer_pool:
            self._pool_receive_buffers(parallel.num_stages)
        self._defer_reduce = False
        if p.patch_stage_backward_maybe_with_nosync:
            for stage in stages_of(self.schedule):
                _defer_fsdp_reduce(stage, self)

    def _pool_receive_buffers(self, num_stages: int) -> None:
        p = self.setup.pipeline
        if not pool_schedule(self.schedule, stages_of(self.schedule), num_stages,
                             self.n_microbatches, p.pp_recv_buffer_pool_slack):
            log.warning("pipeline.pp_recv_buffer_pool applies to the 1f1b and interleaved_1f1b "
                        "(or dfs) schedules only; ignored for %s",
                        p.pp_schedule_csv or p.pp_schedule)

    def local_recv_buffer_bytes(self) -> int:
        """Receive-buffer bytes of this rank's stages (the step sums them over pp ranks)."""
        return sum(recv_buffer_bytes(s) for s in stages_of(self.schedule))

    def _activation_dtype(self) -> torch.dtype:
        """What flows between stages: pipeline.dtype, else FSDP2's parameter dtype, else the
        model's."""
        p, setup = self.setup.pipeline, self.setup
        if p.dtype is not None:
            return getattr(torch, p.dtype)
        if setup.mp_policy is not None:  # (FSDP2's: set by its strategy's check only)
            name = setup.mp_policy.kwargs.get("param_dtype")
            if name is not None:
                return getattr(torch, name)
        return next(self.parts[0].parameters()).dtype

    def __call__(self, micro_batches, max_grad_norm) -> StepStats:
        """The schedule over the micro-batches, then clip (the optimizer step is the
        caller's). Returns (global mean loss, gradient norm, global token count) as device
        tensors, with the pipeline's receive-buffer bytes as an extra."""
        setup = self.setup
        inputs, labels, stage_kwargs = self._inputs(micro_batches)
        # (the stages take the positions of this rank's tokens from ``setup.cp`` themselves)
        inputs, labels, _ = sequence_shard(inputs, labels, setup)
        global_tokens = count_global_tokens([labels], setup)
        # float64 as a Python float would be; the loss is multiplied by it rounded to float32
        in_schedule = self.n_microbatches if self.scale_in_schedule else 1  # (it divides)
        scale = full(setup.grad_average_size, setup.device) / global_tokens * in_schedule
        self.loss.scale = scale.to(torch.float32)
        sequences = setup.dp_size * inputs.shape[0]  # the global batch
        if self.loss.router is not None:  # coef * the mean aux over the global batch's sequences
            self.loss.router_scale = (self.loss.router.coef * setup.grad_average_size
                                      / sequences * in_schedule)
        losses: list = []  # the scaled loss of each micro-batch, on the last stage
        self.aux_sums = []  # (and its router loss's aux sum)
        chunks = range(0, inputs.shape[0], self.batch)
        with known_packing():
            self._run_schedule(inputs, labels, chunks, losses, stage_kwargs)
        not_in_norm = frozenset()
        if self.tied is not None:
            self.tied.sync_grads()
            not_in_norm = frozenset(self.tied.not_in_norm)
        params = [p for part in self.parts for p in part.parameters()]
        grad_norm = grad_norm_and_clip(params, max_grad_norm, across_group=self.pp_group,
                                       not_in_norm=not_in_norm)
        # [loss sum, aux sum, receive-buffer bytes]: summed over pp (only the last stage has
        # the losses), then the losses over dp x cp
        sums = torch.zeros(3, dtype=torch.float64, device=setup.device)
        if losses:
            sums[:1] += torch.stack([x.detach() for x in losses]).sum().to(torch.float64) \
                / scale
        if self.aux_sums:
            sums[1:2] += torch.stack(self.aux_sums).sum().to(torch.float64)
        sums[2].fill_(float(self.local_recv_buffer_bytes()))  # (a fill: no copy, no sync)
        dist.all_reduce(sums, group=self.pp_group)
        loss_sums = sums[:2]
        if setup.loss_group is not None:
            dist.all_reduce(loss_sums, group=setup.loss_group)
        extra = {"pp_recv_buffer_bytes": sums[2].to(torch.int64)}
        if self.loss.router is not None:
            extra["aux_loss"] = loss_sums[1] / sequences
        return StepStats(loss_sums[0] / global_tokens, grad_norm, global_tokens, extra)

    @torch.no_grad()
    def evaluate(self, micro_batches) -> torch.Tensor:
        """Forward only over the micro-batches: [loss sum (all stages agree), label tokens of
        this rank] in float64, for ``recipes/evaluate.py`` to reduce over data parallelism."""
        setup = self.setup
        inputs, labels, stage_kwargs = self._inputs(micro_batches)
        inputs, labels, _ = sequence_shard(inputs, labels, setup)
        train_scale, self.loss.scale = self.loss.scale, 1.0  # the plain sum
        losses: list = []
        try:
            with known_packing():
                for chunk in range(0, inputs.shape[0], self.batch):
                    chunk_losses: list = []
                    self.schedule.eval(*((inputs[chunk:chunk + self.batch],)
                                         if self.has_first else ()),
                                       target=labels[chunk:chunk + self.batch]
                                       if self.has_last else None,
                                       losses=chunk_losses if self.has_last else None,
                                       **_rows(stage_kwargs, chunk, self.batch))
                    losses.extend(chunk_losses)
        finally:
            self.loss.scale = train_scale
        sums = torch.zeros(2, dtype=torch.float64, device=setup.device)
        if losses:
            sums[0] = torch.stack([x.detach() for x in losses]).sum().to(torch.float64)
        dist.all_reduce(sums[:1], group=self.pp_group)  # only the last stage has the loss
        sums[1] = (labels != IGNORE_INDEX).sum()
        return sums

    def _inputs(self, micro_batches) -> tuple:
        """(token ids, labels, the stages' keyword inputs) of the step's rows on the device.
        An image-text model's micro-batches are the pipeline's (``micro_batch_rows``), each
        with its images; the first stage's are kept on it (``stage_images.py``)."""
        device = self.setup.device
        if not self.images:
            return (to_device(torch.cat([mb[0] for mb in micro_batches]), device),
                    to_device(torch.cat([mb[1] for mb in micro_batches]), device), {})
        part = self.parts[0]
        inputs, labels, kwargs, table = schedule_inputs(
            micro_batches, part.get_submodule(part._pipeline_role.anatomy.base),
            IMAGE_TOKEN_MASKS)
        table.table = {row: {k: to_device(v, device) if isinstance(v, torch.Tensor) else v
                             for k, v in images.items()} for row, images in table.table.items()}
        for part in self.parts:
            part._pipeline_images = table
        kwargs = {k: v if k == ROWS else to_device(v, device) for k, v in kwargs.items()}
        return to_device(inputs, device), to_device(labels, device), kwargs

    def _run_schedule(self, inputs, labels, chunks, losses: list, stage_kwargs: dict) -> None:
        for chunk in chunks:
            # with the no-sync patch, gradients are reduced after the last chunk only
            self._defer_reduce = chunk != chunks[-1]
            args = (inputs[chunk:chunk + self.batch],) if self.has_first else ()
            target = labels[chunk:chunk + self.batch] if self.has_last else None
            chunk_losses: list = []  # the schedule refills this list on every call
            self.schedule.step(*args, target=target,
                               losses=chunk_losses if self.has_last else None,
                               **_rows(stage_kwargs, chunk, self.batch))
            losses.extend(chunk_losses)
            self.aux_sums.extend(self.loss.micro_batch_aux(len(chunk_losses)))


def loader_options(pipeline, image_text: bool, local_batch_size: int) -> dict:
    """``BatchPlan.micro_batches``' size and split for a step (``pipeline``: the pipeline
    section, or None): under a pipeline an image-text model's micro-batches are the
    pipeline's (their images cannot be re-split by the schedule) and take no placeholder rows
    (``stage_images.py``)."""
    if pipeline is None or not image_text:
        return {"local_batch_size": local_batch_size}
    return {"local_batch_size": pipeline.pp_microbatch_size, "placeholder_row": False}


def step_loader_options(step: PipelineStep | None, local_batch_size: int) -> dict:
    """``loader_options`` of a job's pipeline step (None: no pipeline)."""
    return loader_options(step.setup.pipeline if step else None, bool(step and step.images),
                          local_batch_size)


def _rows(stage_kwargs: dict, start: int, count: int) -> dict:
    """The stages' keyword inputs of rows ``start .. start + count``."""
    return {k: v[start:start + count] for k, v in stage_kwargs.items()}


def _forward_under_autocast(part, device_type: str, dtype: torch.dtype) -> None:
    forward = part.forward

    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    part.forward = autocast_forward


def _defer_fsdp_reduce(stage, step: PipelineStep) -> None:
    """pipeline.patch_stage_backward_maybe_with_nosync: when one optimizer step runs several
    schedule steps (pp_batch_size < the per-rank batch), keep FSDP's gradients unreduced
    until the last one instead of reduce-scattering after each."""
    defer_reduce_grad(stage, lambda: step._defer_reduce)
