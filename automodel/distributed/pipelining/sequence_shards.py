"""Pipeline stages under tensor and sequence parallelism (``parallelism.sequence_parallel``).

Inside a stage, sequence parallelism keeps the residual stream a DTensor sharded on the
sequence over the TP ranks (``Shard(1)``, ``distributed/tensor_parallel.py``). Between stages
each TP rank sends only its own shard, ``[batch, seq / tp, hidden]``, as a plain tensor to the
same TP rank of the next stage: a stage's output becomes its local shard, and a received
shard becomes the ``Shard(1)`` DTensor again before the stage's forward runs. That DTensor
reports the whole sequence, so the positions (RoPE) and the attention mask that the stage
builds from its input are those of the whole sequence, as without a pipeline.

The stage shapes follow: ``pipeline_step.py`` gives static shapes (``pipeline.pp_seq_len``)
the local length ``seq / tp`` (per context-parallel rank), and inferred shapes are the
tensors themselves. The first stage takes token ids and the last returns logits (or, with
the fused head, its DTensor hidden states, which the loss gathers): those are not sharded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def apply_sequence_sharded_boundaries(part: nn.Module, tp_mesh: DeviceMesh, first: bool,
                                      last: bool) -> None:
    """Make ``part`` (one pipeline stage) take and return local sequence shards: a stage
    that receives activations (not ``first``) wraps them (its first input) as ``Shard(1)``
    DTensors; a stage that sends them (not ``last``) returns its local shard."""
    if not first:
        def to_dtensor(module, args):
            x, *rest = args
            return (DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False), *rest)

        part.register_forward_pre_hook(to_dtensor)
    if not last:
        def to_local_shard(module, args, output):
            if isinstance(output, tuple):  # the hidden states first (then e.g. routing sums)
                return (local_shard(output[0]), *output[1:])
            return local_shard(output)

        part.register_forward_hook(to_local_shard)


def local_shard(output: torch.Tensor) -> torch.Tensor:
    """This TP rank's ``[batch, seq / tp, hidden]`` shard of a stage's output, as a fresh
    tensor (zero-bubble schedules detach stage outputs in place, which a view forbids)."""
    if not isinstance(output, DTensor):
        raise TypeError(f"a pipeline stage under sequence parallelism returned a plain "
                        f"{type(output).__name__} of shape {tuple(output.shape)}; its last "
                        "layer must return the sequence-sharded residual stream (a DTensor)")
    if output.placements != (Shard(1),):
        output = output.redistribute(placements=[Shard(1)])
    local = output.to_local()
    return local if local._base is None else local.clone()
