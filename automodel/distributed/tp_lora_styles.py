"""Tensor-parallel styles for linear layers that carry LoRA adapters (``peft/lora.py``).

torch's ``ColwiseParallel`` / ``RowwiseParallel`` split every parameter of the module they are
given, its children's included, on the same dimension; an adapter needs its own placement.
For ``W`` [out, in], ``A`` [r, in], ``B`` [out, r]:

- column-wise (``W`` split by output rows, ``Shard(0)``): ``A`` replicated, ``B`` split by
  output rows like ``W``; ``B(A(x))`` comes out split on its last dimension, as ``x W^T`` does;
- row-wise (``W`` split by input columns, ``Shard(1)``): ``A`` split by input columns like
  ``W``, ``B`` replicated; ``A(x)`` is then a partial sum over the ranks, and so is
  ``B(A(x))``, added to the layer's own partial output and reduced with it, once.

The replicated adapter (A column-wise, B row-wise) is a DTensor whose gradient DTensor leaves
as a partial sum over the ranks (``Partial``); a hook reduces it as it arrives, so the
gradient has the parameter's placement (what the optimizer, the gradient norm and FSDP2
expect) and the replicas stay equal. The forward is the layer's own (``LoraLinear.forward``),
run on DTensors.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from automodel.peft.lora import MAGNITUDE

# the placement of each parameter, by submodule ("" the layer itself) and parameter name (DoRA's
# magnitude: one per output row, split with the rows column-wise, whole row-wise)
_COLWISE = {("", "weight"): Shard(0), ("", "bias"): Shard(0), ("lora_B", "weight"): Shard(0),
            ("", MAGNITUDE): Shard(0)}
_ROWWISE = {("", "weight"): Shard(1), ("lora_A", "weight"): Shard(1)}


def _partition(style, table: dict, name: str, module: nn.Module, mesh) -> None:
    """Split the parameters ``table`` names; ``distribute_module`` replicates the rest."""
    for p_name, param in list(module.named_parameters(recurse=False)):
        placement = table.get((name, p_name))
        if placement is None:
            continue
        module.register_parameter(p_name, nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=style.src_data_rank),
            requires_grad=param.requires_grad))


def _reduced_grad(grad):
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(placements=[Replicate()] * len(grad.placements))
    return grad


class _AdapterPlacement:
    """Mixed into torch's styles: ``TABLE`` splits the layer and its adapters, and the
    adapter ``WHOLE`` (replicated) gets its partial gradient summed as it arrives."""

    TABLE: dict
    WHOLE: str

    def _partition_linear_fn(self, name, module, device_mesh):
        _partition(self, self.TABLE, name, module, device_mesh)

    def _apply(self, module, device_mesh):
        module = super()._apply(module, device_mesh)
        getattr(module, self.WHOLE).weight.register_hook(_reduced_grad)
        return module


class LoraColwise(_AdapterPlacement, ColwiseParallel):
    """``ColwiseParallel`` for a ``LoraLinear``: A replicated, B (and DoRA's magnitude)
    split like the weight's rows."""

    TABLE, WHOLE = _COLWISE, "lora_A"


class LoraRowwise(_AdapterPlacement, RowwiseParallel):
    """``RowwiseParallel`` for a ``LoraLinear``: A split like the weight, B replicated (the
    bias, added once after the reduction, replicated as torch's style has it); DoRA's
    magnitude replicated, and the row norms of ``W + s B A``, whose columns are split, summed
    over the ranks in each forward (DTensor's reduction of the norm: one all-reduce of
    ``out`` values; the magnitude's gradient comes out whole)."""

    TABLE, WHOLE = _ROWWISE, "lora_B"


def lora_style(torch_style):
    """The adapter-aware twin of torch's style object ``torch_style`` (same layouts), or None
    where there is none."""
    for base, twin in ((ColwiseParallel, LoraColwise), (RowwiseParallel, LoraRowwise)):
        if type(torch_style) is base:
            out = twin.__new__(twin)
            out.__dict__.update(torch_style.__dict__)
            return out
    return None
