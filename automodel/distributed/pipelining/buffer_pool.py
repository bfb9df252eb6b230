"""Pooled receive buffers (``pipeline.pp_recv_buffer_pool``) for 1F1B and interleaved 1F1B.

torch's PipelineStage allocates one receive buffer set per micro-batch for activations and
one for gradients. A received activation is copied into an independent leaf before the
forward (autograd saves the leaf, not the buffer), and a received gradient is copied before
the backward, so a buffer is free again as soon as its micro-batch has been read. Micro-batch
``k`` then borrows the buffers of its *owner*, the first micro-batch of its buffer set:

- 1F1B: a stage at index ``i`` of ``n`` holds at most ``n - i`` micro-batches in flight, so
  sets form a ring of ``min(micro-batches, n - i + slack)``; ``k`` uses set ``k % ring``.
- Interleaved 1F1B: each receive lives, in this rank's lowered schedule (torch's
  ``pipeline_order_with_comms``, with its RECV_F/RECV_B actions), from the action that posts
  it until the forward (F) or backward (B/I) that reads it. Per stage and direction, those
  intervals are coloured greedily by start, which uses as many sets as the most receives ever
  alive at once; micro-batches of one colour share a set.
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B

from automodel.compat import computation_types, wrap_recv_methods

_ComputationType = computation_types()

_CONSUMERS = {  # receive -> the computations that read its buffer
    _ComputationType.RECV_F: (_ComputationType.FORWARD,),
    _ComputationType.RECV_B: (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT),
}


def ring_size(num_stages: int, stage_index: int, n_microbatches: int, slack: int) -> int:
    return max(1, min(n_microbatches, num_stages - stage_index + slack))


def ring_owners(n_microbatches: int, ring: int) -> dict[int, int]:
    return {k: k % ring for k in range(n_microbatches)}


def receive_lifetimes(actions, stage_index: int, recv) -> dict[int, tuple[int, int]]:
    """{micro-batch: (position of its ``recv`` action, position of the computation that reads
    it)} for one stage, from one rank's lowered action list."""
    start, end = {}, {}
    for pos, action in enumerate(actions):
        if action is None:
            continue
        for a in action.sub_actions or (action,):
            if a.stage_index != stage_index:
                continue
            if a.computation_type == recv:
                start[a.microbatch_index] = pos
            elif a.computation_type in _CONSUMERS[recv] and a.microbatch_index in start:
                end.setdefault(a.microbatch_index, pos)
    missing = set(start) - set(end)
    if missing:
        raise ValueError(f"stage {stage_index}: {recv.value} of micro-batches "
                         f"{sorted(missing)} is never read in the lowered schedule")
    return {k: (start[k], end[k]) for k in start}


def colour_intervals(lifetimes: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Greedy interval colouring by start (optimal for intervals): two micro-batches share a
    colour only if one's buffer is read before the other's receive is posted."""
    colours: dict[int, int] = {}
    free_at: list[int] = []  # colour -> position of the last read of its current holder
    for k, (start, end) in sorted(lifetimes.items(), key=lambda kv: kv[1]):
        c = next((c for c, last in enumerate(free_at) if last < start), len(free_at))
        free_at[c:c + 1] = [end]
        colours[k] = c
    return colours


def owners_from_colours(colours: dict[int, int]) -> dict[int, int]:
    """Each micro-batch -> the first micro-batch of its colour (whose buffers it borrows)."""
    first: dict[int, int] = {}
    for k in sorted(colours):
        first.setdefault(colours[k], k)
    return {k: first[c] for k, c in colours.items()}


def lifetime_owners(actions, stage_index: int) -> tuple[dict[int, int], dict[int, int]]:
    """(activation owners, gradient owners) of one stage from its rank's lowered schedule."""
    return tuple(owners_from_colours(colour_intervals(receive_lifetimes(actions, stage_index,
                                                                        recv)))
                 for recv in (_ComputationType.RECV_F, _ComputationType.RECV_B))


def pool_schedule(schedule, stages, num_stages: int, n_microbatches: int, slack: int) -> bool:
    """Pool the receive buffers of ``stages`` for ``schedule``; False if it is not pooled."""
    if isinstance(schedule, Schedule1F1B):
        for stage in stages:
            owners = ring_owners(n_microbatches,
                                 ring_size(num_stages, stage.stage_index, n_microbatches, slack))
            install_recv_buffer_pool(stage, owners, owners)
        return True
    if isinstance(schedule, ScheduleInterleaved1F1B):
        actions = schedule.pipeline_order_with_comms[schedule.rank]
        for stage in stages:
            install_recv_buffer_pool(stage, *lifetime_owners(actions, stage.stage_index))
        return True
    return False


def _share(recv_info: dict, owners: dict[int, int]) -> None:
    for chunk, infos in recv_info.items():
        owner = owners.get(chunk, chunk)
        if owner != chunk:
            for info, owned in zip(infos, recv_info[owner]):
                if info.buffer is not None:
                    info.buffer = owned.buffer


def install_recv_buffer_pool(stage, forward_owners: dict[int, int],
                             backward_owners: dict[int, int]) -> None:
    """Patch one ``PipelineStage`` instance so micro-batch ``k`` receives activations into
    the buffers of ``forward_owners[k]`` and gradients into those of ``backward_owners[k]``
    (absent keys keep their own)."""

    def pooled_forward_setup(setup_forward, num_microbatches, has_backward):
        setup_forward(num_microbatches, has_backward)
        _share(stage.args_recv_info, forward_owners)

    def pooled_backward_setup(setup_backward, num_microbatches):
        setup_backward(num_microbatches)
        _share(stage.grad_recv_info, backward_owners)

    def activations_as_leaves(retrieve_activations, fwd_chunk_id):
        return tuple(a.detach().clone().requires_grad_(a.requires_grad)
                     for a in retrieve_activations(fwd_chunk_id))

    def copied_grads(retrieve_grads, bwd_chunk_id):
        return tuple(None if g is None else g.clone() for g in retrieve_grads(bwd_chunk_id))

    wrap_recv_methods(stage, forward_setup=pooled_forward_setup,
                      backward_setup=pooled_backward_setup, activations=activations_as_leaves,
                      grads=copied_grads)


def recv_buffer_bytes(stage) -> int:
    """Bytes held by the stage's receive buffers (each shared buffer counted once)."""
    seen, total = set(), 0
    for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
        for infos in table.values():
            for info in infos:
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor) and buf.data_ptr() not in seen:
                    seen.add(buf.data_ptr())
                    total += buf.numel() * buf.element_size()
    return total
