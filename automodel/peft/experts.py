"""LoRA on MoE experts (``peft.experts=true``): adapters on each expert of the fused 3-D
weights.

transformers keeps a MoE layer's experts in one module with weights ``[num_experts, out, in]``
(``[num_experts, in, out]`` where the module says ``is_transposed``), e.g. ``gate_up_proj`` and
``down_proj``. Each such weight gets two parameters of the same module, beside it:
``<weight>_lora_A`` ``[num_experts, r, in]`` and ``<weight>_lora_B`` ``[num_experts, out, r]``,
one low-rank pair per expert. They are per-expert weights like the base's (first dimension
the expert), so expert parallelism splits them with their experts and FSDP2 shards them with
the experts' unit; nothing else in automodel needs to know them.

The experts' computation reads the module's weights; it is given a view of the module whose
weights are ``W + (alpha / r) B A`` per expert (the update merged into the weight as the layer
runs, as peft does for expert parameters), whichever experts implementation the config
names, with or without expert parallelism (``with_adapters``). The cost: one temporary the
size of the layer's (local) expert weights per forward. Dropout and DoRA have no meaning on a
merged weight and are refused with ``peft.experts``.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from automodel.compat import direct_parameters, replace_parameter_table
from automodel.peft.lora import EXPERT_SUFFIXES as SUFFIXES


def expert_weights(module: nn.Module) -> list[str] | None:
    """The names of the per-expert 3-D weights of an experts module automodel knows (one
    transformers' experts interface made: ``num_experts`` and ``is_transposed``), in the
    module's order; None for a module it does not know."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or not isinstance(getattr(module, "is_transposed", None), bool):
        return None
    names = [name for name, p in direct_parameters(module)
             if p is not None and p.dim() == 3 and p.shape[0] == n]
    return names or None


def in_out(module: nn.Module, weight: str) -> tuple[int, int]:
    _, a, b = getattr(module, weight).shape
    return (a, b) if module.is_transposed else (b, a)


def add_expert_lora(module: nn.Module, rank: int, alpha: float, dtype: torch.dtype) -> None:
    """Give every per-expert weight of ``module`` its adapters (allocated where the weight
    is; filled by ``init_adapters``) and route its forward through ``with_adapters``."""
    for weight in expert_weights(module):
        fan_in, fan_out = in_out(module, weight)
        device = getattr(module, weight).device
        module.register_parameter(weight + SUFFIXES[0], nn.Parameter(
            torch.empty(module.num_experts, rank, fan_in, device=device, dtype=dtype)))
        module.register_parameter(weight + SUFFIXES[1], nn.Parameter(
            torch.empty(module.num_experts, fan_out, rank, device=device, dtype=dtype)))
    module.lora_scaling = alpha / rank
    module.forward = types.MethodType(_adapted_forward, module)


def _adapted_forward(self, *args, **kwargs):
    return type(self).forward(with_adapters(self), *args, **kwargs)


def with_adapters(module: nn.Module) -> nn.Module:
    """``module`` (an experts module or a view of one) as its computation must see it: a view
    whose adapted weights are ``W + s B A`` per expert. Any other module as it is."""
    scaling = getattr(module, "lora_scaling", None)
    if scaling is None:
        return module
    table = dict(direct_parameters(module))
    for weight, a, b in expert_adapter_params(module):
        table[weight] = table[weight] + expert_update(a, b, scaling, module.is_transposed).to(
            table[weight].dtype)
    view = object.__new__(type(module))
    view.__dict__.update(module.__dict__)
    replace_parameter_table(view, table)
    return view


def adapted_experts(part: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in part.named_modules() if hasattr(m, "lora_scaling")}


def expert_adapter_params(module: nn.Module) -> list:
    """(weight name, its A, its B) of an adapted experts module."""
    table = dict(direct_parameters(module))
    return [(n[:-len(SUFFIXES[0])], table[n], table[n[:-len(SUFFIXES[0])] + SUFFIXES[1]])
            for n in table if n.endswith(SUFFIXES[0])]


def expert_targets(model: nn.Module) -> dict[str, bool]:
    """Every adapted expert weight of a (whole, unsplit) model by its full name, and whether
    it is stored transposed (``[experts, in, out]``)."""
    return {f"{name}.{weight}": m.is_transposed for name, m in adapted_experts(model).items()
            for weight, _, _ in expert_adapter_params(m)}


def peft_keys(targets: dict) -> dict[str, str]:
    """Our name of each expert adapter -> the name peft gives it. peft wraps an experts module
    once per adapted weight, the first of the module's weights innermost: its adapters sit
    under one ``base_layer.`` per weight wrapped after it."""
    by_module: dict[str, list[str]] = {}
    for full in targets:  # (in the module's own order: add_expert_lora's)
        module, _, weight = full.rpartition(".")
        by_module.setdefault(module, []).append(weight)
    out = {}
    for module, weights in by_module.items():
        for i, weight in enumerate(weights):
            inner = "base_layer." * (len(weights) - 1 - i)
            for ours, theirs in zip(SUFFIXES, ("lora_A", "lora_B")):
                out[f"{module}.{weight}{ours}"] = f"{module}.{inner}{theirs}.weight"
    return out


def to_peft_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our A ``[experts, r, in]`` and B ``[experts, out, r]`` as peft stores an expert
    weight's adapters: A ``[experts x r, in]``, B ``[out, r x experts]`` (rank-major)."""
    experts, rank, fan_in = a.shape
    return a.reshape(experts * rank, fan_in), b.permute(1, 2, 0).reshape(b.shape[1], -1)


def expert_update(a: torch.Tensor, b: torch.Tensor, scaling: float,
                  transposed: bool) -> torch.Tensor:
    """``s B A`` of every expert, in its weight's layout (``[experts, out, in]``, or
    ``[experts, in, out]`` transposed)."""
    delta = torch.bmm(b, a) * scaling
    return delta.transpose(1, 2) if transposed else delta
