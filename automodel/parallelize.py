"""The order in which parallelism is applied to a model. Read this first.

    parts = split_model(model)  (pipeline stages of this rank; else the whole model)
    for part in parts:
        pre_shard_hook -> fused head (the LM head joins the loss) -> tensor parallel
        -> context parallel -> expert parallel -> activation checkpointing -> compile
        -> data parallel (the strategy's wrap: DDP / FSDP2 / ...)
    materialize (the model is built on the meta device: this rank's shards are allocated and
    filled only now; before DDP's wrapping, after FSDP2's; by megatron-fsdp itself, one module
    at a time, under init_fsdp_with_meta_device)

The strategy (``setup.strategy``, an entry of ``config/strategies.py``) supplies the wrap and
says what differs (``materialize_after_wrap``, its ``ac_blocks``, ...); nothing here compares
strategy names, and an unknown strategy cannot get this far.

Under a pipeline with sequence parallelism, each stage sends and receives its TP rank's
local sequence shard (``distributed/pipelining/sequence_shards.py``).

Expert parallelism's experts are FSDP2-sharded on their own mesh (``ep_shard``), before
their block; fully frozen blocks follow ``multimodal.frozen_sharding``
(``distributed/frozen.py``). Megatron-FSDP wraps the model together with its optimizer, in the
runner (``distributed/megatron_fsdp.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from automodel.distributed.activation_checkpointing import apply_ac
from automodel.distributed.compile import apply_compile
from automodel.distributed.context_parallel import apply_cp
from automodel.distributed.expert_parallel import apply_ep
from automodel.distributed.fused_head import apply_fused_head, head_fqn
from automodel.distributed.mesh import MeshAxis
from automodel.distributed.setup import DistributedSetup
from automodel.distributed.tensor_parallel import apply_tp, expand_plan
from automodel.loss import HeadLoss
from automodel.models.parts import block_fqns, replace_module, select_blocks
from automodel.models.tp_plans import select_tp_plan, vision_tp


@dataclass
class ModelParts:
    """What this rank trains: the whole model, or its pipeline stages."""

    parts: list
    stage_ids: list  # pipeline stage index of each part ([0] without a pipeline)
    num_stages: int = 1
    tied_embeddings: bool = False  # split stages hold copies of one embedding/head weight
    head_loss: HeadLoss | None = None  # the part with the LM head, fused with the loss


def parallelize(model: nn.Module, setup: DistributedSetup,
                materialize: Callable[[list], None] | None = None) -> ModelParts:
    """Apply every technique the setup asks for; returns the model parts to train.

    ``materialize``: the model was built on the meta device; this allocates and fills the
    parts, after sharding (FSDP2) or before wrapping (DDP, none: they hold whole weights)."""
    tp_plan = None
    if setup.size(MeshAxis.TP) > 1:
        tp_plan = select_tp_plan(model, setup.options.tp_plan, vision_tp(setup.options),
                                 setup.size(MeshAxis.TP))
        expand_plan(model, *tp_plan)  # every pattern must match the whole model
    if setup.pp_enabled:  # (torch's pipelining imports the compiler stack: only when used)
        from automodel.distributed.pipelining.sequence_shards import (
            apply_sequence_sharded_boundaries,
        )
        from automodel.distributed.pipelining.split import ties_embeddings
        from automodel.distributed.pipelining.stages import split_model
    tied = setup.pp_enabled and ties_embeddings(model)
    if setup.pp_enabled:
        parts, stage_ids, num_stages = split_model(
            model, setup.pipeline, setup.mesh.local_rank(MeshAxis.PP), setup.size(MeshAxis.PP))
    else:
        parts, stage_ids, num_stages = [model], [0], 1
    result, head_loss = [], None
    custom_loss = setup.pipeline is not None and setup.pipeline.loss_fn is not None
    strategy = setup.strategy
    for part, stage in zip(parts, stage_ids):
        if setup.pre_shard_hook is not None:
            setup.pre_shard_hook(part)
        blocks = block_fqns(part)
        # (Megatron-FSDP keeps the weights in its own buffers: the plain loss there)
        loss = "plain" if strategy.plain_loss_reason is not None else setup.loss
        fused = apply_fused_head(part, loss, setup.loss_chunk_tokens, stage == num_stages - 1,
                                 custom_loss, show_use=strategy.reducer_walks_outputs)
        head_loss = fused or head_loss
        if tp_plan is not None:
            opts = setup.options
            apply_tp(part, setup.mesh[MeshAxis.TP], *tp_plan, blocks, opts.sequence_parallel,
                     opts.enable_async_tensor_parallel, pipeline_stage=setup.pp_enabled,
                     vocab_parallel_head=head_fqn(part) if fused else None)
            if setup.pp_enabled and opts.sequence_parallel:  # stages pass local shards
                apply_sequence_sharded_boundaries(part, setup.mesh[MeshAxis.TP], stage == 0,
                                                  stage == num_stages - 1)
        if setup.cp is not None:
            apply_cp(part, setup.cp)
        experts = apply_ep(part, setup.mesh.moe["ep"]) if setup.ep_enabled else []
        ac_blocks = select_blocks(part, setup.activation_checkpointing_scope)
        if strategy.ac_blocks is not None:  # (megatron_fsdp: the MLP layers, as its reference)
            ac_blocks = strategy.hook("ac_blocks")(part, ac_blocks)
        apply_ac(part, ac_blocks, setup.activation_checkpointing, replace_module,
                 setup.activation_checkpointing_scope)
        if getattr(setup.options, "enable_compile", False):
            apply_compile(part, blocks)
        if materialize is not None and not strategy.materialize_after_wrap:
            _materialize_before_wrap(part, materialize, setup)
        result.append(apply_data_parallel(part, blocks, setup, experts))
    if materialize is not None and strategy.materialize_after_wrap:
        materialize(result)  # every part at once: one pass over the weights
    return ModelParts(result, stage_ids, num_stages, tied, head_loss)


def _materialize_before_wrap(part: nn.Module, materialize: Callable[[list], None],
                             setup: DistributedSetup) -> None:
    """Allocate and fill a meta part that the wrap takes whole (DDP, none), or as the
    strategy's ``materialize`` hook does it (megatron-fsdp may allocate it itself)."""
    if setup.strategy.materialize is not None:
        setup.strategy.hook("materialize")(part, materialize, setup)
    else:
        materialize([part])


def apply_data_parallel(part: nn.Module, blocks: list[str], setup: DistributedSetup,
                        experts: list) -> nn.Module:
    """The strategy's data-parallel wrap of one part (DDP, FSDP2, ...). A strategy without a
    wrap (one process; megatron_fsdp, which wraps the model with its optimizer in
    ``recipes/components.py``) leaves the part as it is."""
    if setup.strategy.wrap is None:
        return part
    return setup.strategy.hook("wrap")(part, blocks, setup, experts)
