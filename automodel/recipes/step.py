"""One optimizer step: micro-batches with gradient accumulation, the global loss, clipping.

The loss of a step is the mean token cross-entropy over the whole global batch (all ranks,
all micro-batches), so every layout reports the same number for the same data. Each
micro-batch's backward uses ``sum / global_tokens * (dp * cp)`` because DDP and FSDP2 average
gradients over the data-parallel and context-parallel ranks (``grad_average_size``). Under
context parallelism each rank holds its share of every sequence's tokens (``setup.cp``) with
their global positions.

No host reads: on a GPU each ``.item()``, ``float(t)``, ``.tolist()`` or Python branch on a
tensor waits until the device has caught up. The step keeps its token count, loss scale,
clipping coefficient and results on the device and returns them as ``StepStats``; the runner
reads them, with its own per-step values, in one transfer (``recipes/step_values.py``).
Host-to-device copies are asynchronous too (a plain ``.to(cuda)`` waits for the stream).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from automodel.compat import foreach_mul_, foreach_norm, packed_sequence_finder
from automodel.data.batches import IGNORE_INDEX
from automodel.data.image_text import PLACEHOLDER_ROWS
from automodel.distributed.setup import DistributedSetup
from automodel.loss import summed_cross_entropy
from automodel.recipes.router_loss import RouterLoss


class StepStats(NamedTuple):
    """What a step returns, still on the device (the same values on every rank)."""

    loss: torch.Tensor  # 0-dim float64: mean token loss over the global batch
    grad_norm: torch.Tensor  # 0-dim: global gradient norm before clipping
    tokens: torch.Tensor  # 0-dim float64: label tokens of the global batch
    extra: Optional[dict] = None  # more 0-dim tensors to log, by name


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without waiting for the device: from pinned memory,
    non-blocking (a pageable, blocking copy synchronizes the CUDA stream)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def full(value: float, device: torch.device, dtype=torch.float64) -> torch.Tensor:
    """A 0-dim tensor made on the device from a host number (a fill: no copy, no sync)."""
    return torch.full((), value, dtype=dtype, device=device)


def _no_packed_sequences(position_ids):
    return None


def _packed_sequences(position_ids):
    """Which document each token belongs to, from positions restarting at each document
    (transformers' rule, without its early exit: that reads the device)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


@contextlib.contextmanager
def known_packing(packed: bool = False):
    """While the model runs: transformers' check for packed sequences answers without
    reading the device.

    Without an attention mask, transformers looks for several sequences packed in one row in
    the position ids (``find_packed_sequence_indices``) on every forward, a Python branch on a
    tensor: a device sync per forward. Rows without document boundaries have full-length
    positions ``0..L-1``, for which the answer is "none"; rows packed with boundaries
    (``data.pack_boundaries``, positions restarting at each document) get the document of
    every token, which keeps attention inside documents."""
    with packed_sequence_finder(_packed_sequences if packed else _no_packed_sequences):
        yield


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def grad_sync_context(model, setup: DistributedSetup, is_last: bool):
    """Skip the gradient reduce on all but the last micro-batch where the strategy allows:
    its ``GradSync.defer`` hook (``config/strategies.py``; DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync``, ...). A strategy without one reduces every micro-batch."""
    sync = setup.strategy.grad_sync
    context = None if sync.defer is None else setup.strategy.hook("defer")(model, setup, is_last)
    return contextlib.nullcontext() if context is None else context


def finish_grad_sync(model, setup: DistributedSetup) -> None:
    """After the last micro-batch's backward, before clipping: the strategy's
    ``GradSync.finish`` (megatron-fsdp waits for its reduction still running)."""
    if setup.strategy.grad_sync.finish is not None:
        setup.strategy.hook("finish")(model, setup)


def autocast_context(setup: DistributedSetup):
    dtype = setup.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=setup.device.type, dtype=dtype)


def grad_norm_and_clip(parameters, max_grad_norm, across_group=None,
                       not_in_norm: frozenset = frozenset()) -> torch.Tensor:
    """Global L2 norm of all gradients (a 0-dim float32 tensor, not read on the host), then
    clip to ``max_grad_norm`` (null: no clipping) by a coefficient that stays on the device.

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
    device = next(iter(groups.values()))[0].device if groups else torch.device("cpu")
    partial_norms = []
    for grads in counted.values():
        norms = foreach_norm(grads, 2.0)
        group_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()
        partial_norms.append(group_norm)
    total = (torch.linalg.vector_norm(torch.stack(partial_norms), 2.0) if partial_norms
             else torch.zeros((), dtype=torch.float32, device=device))
    if across_group is not None:
        squared = (total.to(torch.float64) ** 2).reshape(1)
        dist.all_reduce(squared, group=across_group)
        total = squared.sqrt()[0].to(torch.float32)
    if max_grad_norm is not None:
        coef = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            foreach_mul_(grads, coef.to(grads[0].device))
    return total


def count_global_tokens(labels, setup: DistributedSetup) -> torch.Tensor:
    """Label tokens of the whole global batch (all data-parallel ranks), counted on the device
    from ``labels`` (tensors on ``setup.device``): a 0-dim float64 tensor (exact below 2**53)."""
    local = torch.stack([(y != IGNORE_INDEX).sum() for y in labels]).sum()
    return _all_reduce_sum(local.to(torch.float64).reshape(1), setup.loss_group)[0]


def sequence_shard(inputs: torch.Tensor, labels: torch.Tensor, setup: DistributedSetup):
    """This rank's tokens of a micro-batch and their global positions (full-length positions
    ``0..L-1`` without context parallelism): (inputs, labels, position_ids)."""
    cp = setup.cp
    if cp is None:
        return inputs, labels, torch.arange(inputs.shape[1], device=inputs.device)
    if cp.whole_inputs:  # (an image-text model: its language model takes its tokens)
        return inputs, cp.shard(labels), torch.arange(inputs.shape[1], device=inputs.device)
    return (cp.shard(inputs), cp.shard(labels),
            cp.positions(inputs.shape[1], inputs.device))


def device_batches(micro_batches, setup: DistributedSetup) -> list:
    """The micro-batches on the device as (inputs, labels, positions, extras), this rank's
    share of the sequence under context parallelism."""
    batches = []
    for x, y, *rest in micro_batches:  # (inputs, labels[, extras: images, positions])
        extras = {k: to_device(v, setup.device) if isinstance(v, torch.Tensor) else v
                  for k, v in (rest[0] if rest else {}).items()}
        batches.append((*sequence_shard(to_device(x, setup.device),
                                        to_device(y, setup.device), setup), extras))
    return batches


def forward_loss(model, setup: DistributedSetup, batch, extra_args: dict | None = None,
                 head_loss=None):
    """(model output, summed token cross-entropy) of one device micro-batch: the loss of
    training and of evaluation (the pipeline's last stage computes the same one).
    ``head_loss``: the model's LM head was fused with the loss (``automodel/loss.py``): the
    model returns hidden states and this applies the head."""
    inputs, labels, positions, extras = batch
    # Positions explicitly: under sequence or context parallelism a model would otherwise
    # derive them from its local shard of the sequence. Extras may replace them: positions
    # restarting at each packed document, or None for a model that derives them from its
    # images.
    args = {"position_ids": positions.expand_as(inputs), **extras, **(extra_args or {})}
    args.pop(PLACEHOLDER_ROWS, None)  # (not a model input)
    packed = extras.get("position_ids") is not None
    with autocast_context(setup), known_packing(packed):
        with record_function("automodel::forward"):
            out = model(input_ids=inputs, use_cache=False, **args)
        with record_function("automodel::loss"):
            if head_loss is not None:
                return out, head_loss(out.logits, labels)
    with record_function("automodel::loss"):
        return out, summed_cross_entropy(out.logits, labels)


def _samples(micro_batch) -> int:
    """The rows of a micro-batch (host or device form) that are samples of the batch: all but
    an image-text micro-batch's placeholder row (``ImageTextData.split``)."""
    extras = micro_batch[-1] if isinstance(micro_batch[-1], dict) else {}
    return micro_batch[0].shape[0] - extras.get(PLACEHOLDER_ROWS, 0)


def train_step(model, setup: DistributedSetup, micro_batches, max_grad_norm,
               router_loss: Optional[RouterLoss] = None, head_loss=None) -> StepStats:
    """Forward and backward over the micro-batches, then clip; the optimizer step is the
    caller's. Returns (global mean loss, gradient norm before clipping, global token count)
    as device tensors, the same values on every rank: nothing is read on the host.

    ``router_loss`` (a mixture-of-experts model whose config asks for it): ``coef * aux``
    joins the objective, ``aux`` being the mean over the global batch's sequences; it is
    logged as ``aux_loss``, and ``loss`` stays the token cross-entropy."""
    device = setup.device
    group = setup.loss_group
    batches = device_batches(micro_batches, setup)
    global_tokens = count_global_tokens([b[1] for b in batches], setup)
    # (dp * cp) / global_tokens in float64 (as a Python float would be), rounded once to the
    # loss's float32
    scale = (full(setup.grad_average_size, device) / global_tokens).to(torch.float32)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, aux sum]
    sequences = setup.dp_size * sum(_samples(mb) for mb in micro_batches)  # global batch
    extra_args = {"output_router_logits": True} if router_loss is not None else {}
    cp_group = setup.cp.cp_group if setup.cp is not None else None
    for i, batch in enumerate(batches):
        inputs = batch[0]
        try:
            with grad_sync_context(model, setup, i == len(batches) - 1):
                out, mb_loss = forward_loss(model, setup, batch, extra_args, head_loss)
                objective = mb_loss * scale
                if router_loss is not None:  # (the samples' terms: no placeholder row's)
                    aux = router_loss.per_sequence(out.router_logits, inputs.shape[0],
                                                   cp_group)[:_samples(batch)].sum()
                    objective = objective + aux * (router_loss.coef * setup.grad_average_size
                                                   / sequences)
                    sums[1] += aux.detach().to(torch.float64)
                with record_function("automodel::backward"):
                    objective.backward()
        except RuntimeError as err:
            if setup.strategy.backward_error is not None:  # (DDP: parameters without grads)
                raise setup.strategy.hook("backward_error")(err) from err
            raise
        sums[0] += mb_loss.detach().to(torch.float64)
    finish_grad_sync(model, setup)
    with record_function("automodel::clip"):
        grad_norm = grad_norm_and_clip(model.parameters(), max_grad_norm)
    sums = _all_reduce_sum(sums, group)
    extra = {"aux_loss": sums[1] / sequences} if router_loss is not None else None
    return StepStats(sums[0] / global_tokens, grad_norm, global_tokens, extra)
