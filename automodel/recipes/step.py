"""One optimizer step: micro-batches with gradient accumulation, the global loss, clipping.

The loss of a step is the mean token cross-entropy over the whole global batch (all ranks,
all micro-batches), so every layout reports the same number for the same data. Each
micro-batch's backward uses ``sum / global_tokens * dp_size`` because DDP and FSDP2 average
gradients over the data-parallel ranks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from automodel.distributed.setup import DistributedSetup

IGNORE_INDEX = -100


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def grad_sync_context(model, setup: DistributedSetup, is_last: bool):
    """Skip the gradient reduce on all but the last micro-batch where the strategy allows."""
    if setup.strategy == "ddp" and not is_last:
        return model.no_sync()
    if setup.strategy == "fsdp2" and setup.options.defer_fsdp_grad_sync:
        model.set_requires_gradient_sync(is_last)
    return contextlib.nullcontext()


def autocast_context(setup: DistributedSetup):
    dtype = setup.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=setup.device.type, dtype=dtype)


def _ddp_hint(err: RuntimeError) -> RuntimeError:
    text = str(err)
    if "Expected to have finished reduction" in text or "did not receive grad" in text:
        return RuntimeError("DDP found parameters that received no gradient (a branch of the "
                            "model was not used). Set parallelism.find_unused_parameters=true."
                            f"\n{text}")
    return err


def grad_norm_and_clip(parameters, max_grad_norm, across_group=None,
                       not_in_norm: frozenset = frozenset()) -> float:
    """Global L2 norm of all gradients, then clip to ``max_grad_norm`` (null: no clipping).

    Gradients may be plain tensors and DTensors on different meshes (FSDP2 shards, TP shards,
    both): norms are taken per group of like gradients, each made global, then combined.
    ``across_group`` sums the squares over ranks holding different parameters (pipeline).
    ``not_in_norm``: ids of parameters clipped but not counted (a second copy of a weight
    whose gradient another copy counts).
    """
    groups: dict = {}
    counted: dict = {}
    for p in parameters:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
            if id(p) not in not_in_norm:
                counted.setdefault(key, []).append(g)
    partial_norms = []
    for grads in counted.values():
        norms = torch._foreach_norm(grads, 2.0)
        group_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()
        partial_norms.append(group_norm)
    total = (torch.linalg.vector_norm(torch.stack(partial_norms), 2.0) if partial_norms
             else torch.zeros((), dtype=torch.float32))
    if across_group is not None:
        squared = (total.to(torch.float64) ** 2).reshape(1)
        dist.all_reduce(squared, group=across_group)
        total = squared.sqrt()[0].to(torch.float32)
    if max_grad_norm is not None:
        coef = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef.item())
    return float(total)


def count_global_tokens(micro_batches, setup: DistributedSetup) -> int:
    """Label tokens of the whole global batch (all data-parallel ranks)."""
    local = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
    t = torch.tensor([local], dtype=torch.float64, device=setup.device)
    return int(_all_reduce_sum(t, setup.dp_group).item())


def train_step(model, setup: DistributedSetup, micro_batches, max_grad_norm):
    """Forward and backward over the micro-batches, then clip; the optimizer step is the
    caller's. Returns (global mean loss, gradient norm before clipping, global token count),
    the same numbers on every rank."""
    device = setup.device
    group = setup.dp_group
    global_tokens = count_global_tokens(micro_batches, setup)
    scale = setup.dp_size / global_tokens
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, (inputs, labels) in enumerate(micro_batches):
        inputs, labels = inputs.to(device), labels.to(device)
        # Full-length positions, explicitly: under sequence parallelism a model would
        # otherwise derive them from its local shard of the sequence.
        positions = torch.arange(inputs.shape[1], device=device).expand_as(inputs)
        try:
            with grad_sync_context(model, setup, i == len(micro_batches) - 1):
                with autocast_context(setup):
                    logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
                mb_loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                          ignore_index=IGNORE_INDEX, reduction="sum")
                (mb_loss * scale).backward()
        except RuntimeError as err:
            if setup.strategy == "ddp":
                raise _ddp_hint(err) from err
            raise
        loss_sum += mb_loss.detach().to(torch.float64)
    grad_norm = grad_norm_and_clip(model.parameters(), max_grad_norm)
    loss = float(_all_reduce_sum(loss_sum, group).item()) / global_tokens
    return loss, grad_norm, global_tokens
