"""Sequence and context parallelism for image-text models: the images are merged on the full
sequence.

An image-text model embeds its tokens, writes the image features over the image tokens'
embeddings (on the whole sequence: the image positions are anywhere in it) and hands the
result to its language model as ``inputs_embeds``. Under sequence parallelism the embedding
therefore keeps its output whole (as without SP), and the language model's stack splits the
sequence on entry: ``inputs_embeds`` becomes a DTensor sharded on the sequence (each TP rank
keeps its chunk: no communication), so the stack's own mask and position logic still see the
full length, as for a text model. In the backward the chunks' gradients are all-gathered,
so the merged embeddings, the projector and a trainable tower get whole gradients on every
TP rank (the tower is replicated over TP).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


class ShardSequenceOnEntry(ParallelStyle):
    """The language stack's ``inputs_embeds`` (whole, replicated over TP) as a ``Shard(1)``
    DTensor: this rank's chunk of the sequence, the full length reported."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def hook(mod, args, kwargs):
            x = kwargs.get("inputs_embeds")
            if x is not None and not isinstance(x, DTensor):
                whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                kwargs = dict(kwargs, inputs_embeds=whole.redistribute(mesh, [Shard(1)]))
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def split_sequence_on_entry(stack: nn.Module, cp) -> None:
    """Context parallelism of an image-text model: the language stack (``stack``) takes this
    cp rank's tokens of the merged ``inputs_embeds`` and of the positions (whole positions
    made where the model passes none; 3-D rotary positions split on their last dimension),
    as a text model's step takes its tokens (``ContextParallel.shard``)."""
    import torch

    def hook(mod, args, kwargs):
        x = kwargs.get("inputs_embeds")
        if x is None:
            return args, kwargs
        if x.shape[1] % (2 * cp.size):
            raise ValueError(f"mesh.cp_size={cp.size}: {type(mod).__name__} received a sequence of "
                             f"{x.shape[1]} tokens, which does not split into 2 * cp_size = "
                             f"{2 * cp.size} equal chunks; make trainer.seq_len a multiple of "
                             f"{2 * cp.size}")
        index = cp.positions(x.shape[1], x.device)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return args, dict(kwargs, inputs_embeds=x.index_select(1, index),
                          position_ids=positions.index_select(positions.dim() - 1, index))

    # (first: under TP+SP the sequence-parallel split then takes this rank's tokens)
    stack.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


def context_parallel_refusal(model: nn.Module) -> str | None:
    """Why an image-text model cannot split its sequences over cp ranks (None: it can, or
    it is a text model): image tokens that attend both ways; image features added inside
    the language layers at positions of the whole sequence (deepstack); a language model
    whose attention implementation cannot be set apart from the tower's."""
    from automodel.compat import can_set_attn_implementation
    from automodel.models.multimodal import (
        adds_features_inside_layers,
        attends_images_both_ways,
        language_stack,
    )
    from automodel.models.parts import block_fqns

    stack = language_stack(model, block_fqns(model))
    if stack is None:
        return None
    if attends_images_both_ways(model):
        return ("lets its image tokens attend to each other both ways (it takes "
                "token_type_ids); the context-parallel attention is causal only")
    language = model.get_submodule(stack)
    if adds_features_inside_layers(model):
        return ("adds image features inside its language layers at image positions of the "
                "whole sequence (deepstack)")
    if not (hasattr(language, "set_attn_implementation")
            and can_set_attn_implementation(language)):
        return (f"has a language model ({stack}, {type(language).__name__}) whose attention "
                "cannot be routed apart from the tower's")
    return None
