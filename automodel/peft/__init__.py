"""Parameter-efficient fine-tuning: adapters beside frozen base weights (docs/peft.md)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from automodel.config import schema as s
from automodel.config.enums import PeftMethod
from automodel.models.experts import expert_modules
from automodel.peft.experts import adapted_experts, add_expert_lora, expert_adapter_params
from automodel.peft.lora import add_lora, fans, initial_a, is_adapter, lora_modules
from automodel.peft.nf4 import dequantized, quantize
from automodel.peft.targets import AdapterError, adapter_targets

__all__ = ["AdapterError", "adapted_meta_model", "adapter_targets", "add_adapters",
           "init_adapters", "is_adapter", "uses_adapters"]

log = logging.getLogger(__name__)


def uses_adapters(peft: s.PeftConfig) -> bool:
    return peft.method != PeftMethod.none


def add_adapters(model: nn.Module, peft: s.PeftConfig, loss: str = "auto",
                 freeze: tuple = ()) -> list[str]:
    """Put adapters on the targeted layers of ``model`` (built, on the host or the meta
    device) and freeze every other parameter, stored in ``peft.base_dtype`` (null: as built).
    Returns the adapted modules' names."""
    if not uses_adapters(peft):
        return []
    targets = adapter_targets(model, peft, loss, freeze)
    experts = expert_modules(model)
    if experts and not peft.experts:
        log.warning("peft: the experts of %d MoE layers take no adapters (peft.experts=false): "
                    "they stay as they are, while the attention, shared experts and dense "
                    "layers get adapters", len(experts))
    base = getattr(torch, peft.base_dtype) if peft.base_dtype else None
    for p in model.parameters():  # (a tied weight is one parameter: cast once)
        p.requires_grad_(False)
        if base is not None and p.is_floating_point() and p.dtype != base:
            p.data = p.data.to(base)  # (the frozen base in peft.base_dtype)
    dtype = getattr(torch, peft.lora_dtype)
    for name in targets:
        module = model.get_submodule(name)
        if peft.method == PeftMethod.qlora:
            quantize(module, peft.nf4_block_size, peft.nf4_scaler_block_size)
        add_lora(module, peft.rank, peft.alpha, peft.dropout, dtype, peft.use_dora)
    if peft.experts:
        for module in experts.values():
            add_expert_lora(module, peft.rank, peft.alpha, dtype)
    return targets


def adapted_meta_model(cfg) -> nn.Module:
    """The run's model on the meta device with its adapters (``cfg``: a ``TrainConfig``): what
    the planner and the preflight's fake step simulate (frozen base weights take no gradient
    and no optimizer state there either)."""
    from automodel.models.builder import build_meta_model

    model = build_meta_model(cfg.model)
    add_adapters(model, cfg.peft, str(cfg.trainer.loss), tuple(cfg.model.freeze))
    return model


@torch.no_grad()
def init_adapters(parts: list[nn.Module], peft: s.PeftConfig, seed: int) -> None:
    """Fill every adapter of ``parts`` (allocated: after ``to_empty``, sharded or whole, the
    base weights filled) with its first value: A from the module's own seeded draw, B zero,
    DoRA's magnitudes the base weight's row norms (collective over a sharded weight's mesh:
    every rank of it runs this for the same modules, in the same order)."""
    from automodel.compat import unwrapped_name
    from automodel.distributed.materialize import fill_from_full

    for part in parts:
        for name, m in lora_modules(part).items():
            a = initial_a(unwrapped_name(name), (peft.rank, fans(m)[0]), seed,
                          str(peft.init_lora_weights))
            fill_from_full(m.lora_A.weight, a.to(m.lora_A.weight.dtype))
            fill_from_full(m.lora_B.weight, torch.zeros(m.lora_B.weight.shape,
                                                        dtype=m.lora_B.weight.dtype))
            if m.use_dora:
                magnitude = m.lora_magnitude_vector
                fill_from_full(magnitude, row_norms(m.out_in_weight()).to(magnitude.dtype))
        for name, m in adapted_experts(part).items():
            for weight, a, b in expert_adapter_params(m):
                a0 = initial_a(f"{unwrapped_name(name)}.{weight}", tuple(a.shape), seed,
                               str(peft.init_lora_weights))
                fill_from_full(a, a0.to(a.dtype))
                fill_from_full(b, torch.zeros(b.shape, dtype=b.dtype))


def row_norms(weight: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each row of ``weight`` (dequantized; a DTensor's rows whole: the norms
    of rows split over ranks are reduced), on the host, float32."""
    from torch.distributed.tensor import DTensor

    norms = torch.linalg.vector_norm(dequantized(weight).float(), dim=1)
    return norms.full_tensor() if isinstance(norms, DTensor) else norms
