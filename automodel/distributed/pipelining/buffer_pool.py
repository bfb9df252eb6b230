"""Pooled receive buffers for 1F1B (``pipeline.pp_recv_buffer_pool``).

torch's PipelineStage allocates one receive buffer per micro-batch for activations and one
for gradients. Under 1F1B a stage at index ``i`` of ``n`` holds at most ``n - i`` micro-batches
in flight, so buffers are shared in a ring of ``min(micro-batches, n - i + slack)`` sets,
micro-batch ``k`` using set ``k % ring``. A received activation is copied into an independent
leaf before the forward (autograd saves the leaf, not the buffer), and a received gradient is
copied before the backward, so a buffer may be refilled as soon as it has been read.
Buffer memory shrinks by about ``micro-batches / ring``.
"""

from __future__ import annotations

import torch


def ring_size(num_stages: int, stage_index: int, n_microbatches: int, slack: int) -> int:
    return max(1, min(n_microbatches, num_stages - stage_index + slack))


def _share(recv_info: dict, ring: int) -> None:
    for chunk, infos in recv_info.items():
        if chunk >= ring:
            for info, owner in zip(infos, recv_info[chunk % ring]):
                if info.buffer is not None:
                    info.buffer = owner.buffer


def install_recv_buffer_pool(stage, ring: int) -> None:
    """Patch one ``PipelineStage`` instance to pool its receive buffers in ``ring`` sets."""
    setup_forward = stage._setup_forward_recv_info
    setup_backward = stage._setup_backward_recv_info
    retrieve_activations = stage._retrieve_recv_activations
    retrieve_grads = stage._retrieve_recv_grads

    def pooled_forward_setup(num_microbatches, has_backward):
        setup_forward(num_microbatches, has_backward)
        _share(stage.args_recv_info, ring)

    def pooled_backward_setup(num_microbatches):
        setup_backward(num_microbatches)
        _share(stage.grad_recv_info, ring)

    def activations_as_leaves(fwd_chunk_id):
        return tuple(a.detach().clone().requires_grad_(a.requires_grad)
                     for a in retrieve_activations(fwd_chunk_id))

    def copied_grads(bwd_chunk_id):
        return tuple(None if g is None else g.clone() for g in retrieve_grads(bwd_chunk_id))

    stage._setup_forward_recv_info = pooled_forward_setup
    stage._setup_backward_recv_info = pooled_backward_setup
    stage._retrieve_recv_activations = activations_as_leaves
    stage._retrieve_recv_grads = copied_grads
    stage.recv_buffer_ring = ring


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
