"""Tensor-parallel styles torch does not ship, for style names of Hugging Face plans.

Each is a small ``ParallelStyle``: the module keeps its parameter names, and only the
forward's inputs, outputs or parameters are seen differently.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from automodel.compat import direct_parameters, set_parameter


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module that runs on TP-local activations with weights replicated over TP (Qwen3's
    per-head q/k norm on local heads; an activation with parameters, such as Apertus' xIELU,
    on the local features of a column-wise projection): the input is seen as sharded on
    ``input_dim`` (-2: heads; -1: features), so the weights' gradients are summed over the
    TP ranks."""

    def __init__(self, input_dim: int = -2):
        super().__init__()
        self.input_dim = input_dim

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        dim = self.input_dim

        def replicate_params(name, mod, mesh):
            for p_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(
                    DTensor.from_local(param, mesh, [Replicate()], run_check=False)))

        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(x.dim() + dim)], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                         for x in inputs)

        def to_local(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, mesh, replicate_params, to_dtensor, to_local)


class GatherSequenceOnEntry(ParallelStyle):
    """Sequence parallelism: all-gather the ``Shard(1)`` residual stream into a full local
    tensor before an attention or MLP block (positional or ``hidden_states=`` argument)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def gather(x):
            if isinstance(x, DTensor):
                return x.redistribute(placements=[Replicate()]).to_local()
            return x

        def hook(mod, args, kwargs):
            if args:
                args = (gather(args[0]),) + tuple(args[1:])
            if "hidden_states" in kwargs:
                kwargs = dict(kwargs, hidden_states=gather(kwargs["hidden_states"]))
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class _SumOverGroup(torch.autograd.Function):
    """Forward: sum over the group (a partial result becomes whole). Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradOverGroup(torch.autograd.Function):
    """Forward: identity. Backward: the gradient is summed over the group (each rank's
    consumers saw only their share of the heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


class AllReduceOutput(ParallelStyle):
    """``all_reduce``: the module returns a partial sum (e.g. over its TP-sharded inner
    layers); the sum over TP is taken on exit."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        group = mesh.get_group()

        def hook(mod, args, output):
            return None if output is None else _SumOverGroup.apply(_local(output), group)

        module.register_forward_hook(hook)
        return module


class MlaKvAProj(ParallelStyle):
    """``mla_kv_a_proj``: the output of a replicated KV down-projection is [latent, rope];
    the latent part reaches the heads through a colwise up-projection (which sums its input
    gradient already), the rope part reaches this rank's heads directly, so its gradient is
    summed over TP here."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        group = mesh.get_group()

        def hook(mod, args, output):
            rope = mod.rope_dim
            latent, rot = _local(output).split([output.shape[-1] - rope, rope], dim=-1)
            return torch.cat([latent, _SumGradOverGroup.apply(rot, group)], dim=-1)

        module.register_forward_hook(hook)
        return module


class LocalParams(ParallelStyle):
    """``local_params``: the module computes with the local shards of its own sharded
    parameters (e.g. attention sinks split per head by a parameter-level ``colwise`` entry);
    gradients flow back into the shards."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        saved: dict = {}

        def pre(mod, args):
            for name, param in direct_parameters(mod):
                if isinstance(param, DTensor):
                    saved[name] = param
                    set_parameter(mod, name, param.to_local())

        def post(mod, args, output):
            for name, param in saved.items():
                set_parameter(mod, name, param)
            saved.clear()

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post, always_call=True)
        return module



def _split_own_table(style, name, module, mesh, dim: int) -> None:
    """An embedding style's partition function that splits only the module's own table on
    ``dim``: torch's splits every parameter of the module, its submodules' included (a norm
    inside the embedding's forward, as in Inkling's normed embedding, would be split and
    fail); the submodules' weights are replicated (``distribute_module`` does that)."""
    if name:  # a submodule
        return
    for p_name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(p_name, nn.Parameter(
            distribute_tensor(param, mesh, [Shard(dim)], src_data_rank=style.src_data_rank),
            requires_grad=param.requires_grad))


def _whole_inputs_for_submodules(module: nn.Module) -> None:
    """A submodule of a row-wise split embedding (a norm after the lookup) sees the lookup's
    partial sums reduced: DTensor reduces a masked lookup only once, and the norm's several
    operations would each try. (A column-wise lookup's features DTensor gathers itself.)"""
    for child in module.children():
        child.register_forward_pre_hook(_replicated_inputs)


def _replicated_inputs(_module, args):
    return tuple(x.redistribute(placements=[Replicate()] * len(x.placements))
                 if isinstance(x, DTensor) and not all(p.is_replicate() for p in x.placements)
                 else x for x in args)


class EmbeddingRowwise(RowwiseParallel):
    """``RowwiseParallel`` on an embedding (split by vocabulary) that may hold submodules."""

    def _partition_embedding_fn(self, name, module, device_mesh):
        _split_own_table(self, name, module, device_mesh, 0)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        _whole_inputs_for_submodules(module)
        return module


class EmbeddingColwise(ColwiseParallel):
    """``ColwiseParallel`` on an embedding (split by features) that may hold submodules."""

    def _partition_embedding_fn(self, name, module, device_mesh):
        _split_own_table(self, name, module, device_mesh, 1)
