"""A strategy registered from outside automodel, as a user would add one: this module (the
schema, the strategy and its hooks) and tests/conf/parallelism/ddp_via_allreduce.yaml (its
option file, found through ``hydra.searchpath``). Importing this module registers
``parallelism=ddp_via_allreduce``; a rank that unpickles the config imports it, so the ranks
know the strategy too.

Every rank holds the whole model; each parameter's gradient is all-reduced (averaged over the
data-parallel ranks) by a post-accumulate-grad hook, in the last micro-batch's backward only.
"""

from dataclasses import dataclass

import torch.distributed as dist

from automodel.config.schema import CommonOptions
from automodel.config.strategies import GradSync, Reduce, Strategy, register_strategy


@dataclass
class AllReduceConfig(CommonOptions):
    """``parallelism=ddp_via_allreduce``: activation checkpointing, compile, autocast and the
    pre-shard hook as every strategy has them."""


def wrap(part, blocks, setup, experts):
    """Hook every trainable parameter: once its gradient has accumulated in a backward that
    syncs, all-reduce it and divide by the data-parallel size."""
    from automodel.distributed.mesh import MeshAxis

    group = setup.mesh[MeshAxis.DP].get_group()
    size = dist.get_world_size(group)
    part.sync_gradients = True
    part.reduces = 0  # gradients all-reduced so far (the test reads it)

    def reduce(param):
        if part.sync_gradients:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(size)
            part.reduces += 1

    for param in part.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(reduce)
    return part


def defer(model, setup, is_last: bool):
    """Only the last micro-batch's backward all-reduces (the earlier ones accumulate)."""
    model.sync_gradients = is_last


TOY = register_strategy(Strategy("ddp_via_allreduce", AllReduceConfig,
                                 GradSync(Reduce.IN_BACKWARD, defer=defer), wrap=wrap))
