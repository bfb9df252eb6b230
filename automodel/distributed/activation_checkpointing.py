"""Activation checkpointing of transformer blocks: full, or selective (op-level save policy)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from automodel.compat import checkpoint_wrapper_api

checkpoint_wrapper = checkpoint_wrapper_api().checkpoint_wrapper
CheckpointImpl = checkpoint_wrapper_api().CheckpointImpl

# Selective checkpointing keeps the outputs of these (expensive to recompute) and recomputes
# everything else (norms, activations, elementwise ops) in backward.
SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


log = logging.getLogger(__name__)


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


def checkpoint_block(block: nn.Module, mode: str) -> nn.Module:
    """Wrap one block. ``mode``: "full" or "selective". Non-reentrant: composes with FSDP2."""
    if mode == "full":
        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                  preserve_rng_state=False)
    if mode == "selective":
        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                  preserve_rng_state=False, context_fn=_selective_context)
    raise AssertionError(f"unexpected activation checkpointing mode {mode!r}")


def apply_ac(model: nn.Module, block_fqns: list[str], mode: str, replace,
             scope: list | None = None) -> None:
    """Wrap the blocks at ``block_fqns`` in place (``replace(model, fqn, new)`` swaps them)."""
    if mode == "none":
        return
    if not block_fqns and scope and scope != ["all"]:
        log.info("activation_checkpointing_scope=%s: no trainable block in scope (frozen "
                 "blocks keep no activations for backward): nothing is checkpointed", scope)
    for fqn in block_fqns:
        replace(model, fqn, checkpoint_block(model.get_submodule(fqn), mode))

