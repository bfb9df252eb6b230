"""LoRA adapters beside a linear layer's weight (or a ``Conv1D``'s), under the layer's own name.

An adapted ``q_proj`` stays the module ``q_proj`` with its ``weight`` (and ``bias``) where
they were; it gains two children, ``lora_A`` ([rank, in]) and ``lora_B`` ([out, rank]), and
computes ``x W^T + b + (alpha / rank) * B(A(dropout(x)))``. So every name the rest of
automodel keys on (tensor-parallel plans, the pipeline split, loading by name, checkpoints
across layouts) is the base model's, and the adapters' names are the ones peft writes
(``<module>.lora_A.weight``).

With ``use_dora`` (DoRA) the layer also gains ``lora_magnitude_vector`` ([out], peft's name),
one length per output row, and computes ``m / ||W + s B A|| * (x (W + s B A)^T) + b``, the
row norms taken as constants (no gradient through them, as DoRA's paper and peft do): the
adapter then changes each row's direction while ``m`` sets its length. ``m`` starts at the
base weight's row norms, so the layer starts as the base.

A starts random and B at zero (the adapted model starts as the base). Each adapter's A is
drawn from a generator seeded by the run's seed and the module's name: the same values in
every layout, on every rank, whatever the order the modules are built or filled in, and
without touching the global random state (dropout draws the same numbers as without
adapters).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from automodel.peft.nf4 import dequantized

ADAPTER_CHILDREN = ("lora_A", "lora_B")
MAGNITUDE = "lora_magnitude_vector"  # DoRA's row lengths, a parameter of the layer itself
EXPERT_SUFFIXES = ("_lora_A", "_lora_B")  # experts: <weight>_lora_A beside <weight> (experts.py)


class LoraLayer:
    """What an adapted layer adds to its base (``LoraLinear``, ``LoraConv1D``; made by
    ``add_lora``, never built directly): ``lora_A`` [rank, in] and ``lora_B`` [out, rank]
    beside the layer's own weight, and under DoRA ``lora_magnitude_vector`` [out]."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float
    use_dora: bool

    def out_in_weight(self) -> torch.Tensor:
        """The base weight as [out, in] (dequantized)."""
        return dequantized(self.weight)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_forward(x)
        h = self.lora_dropout(x)
        update = self.lora_B(self.lora_A(h.to(self.lora_A.weight.dtype))) * self.scaling
        if not self.use_dora:
            return out + update.to(out.dtype)
        return out + self._dora(x, h, out, update.to(out.dtype))

    def _dora(self, x, h, out, update):
        """What DoRA adds to the base output: ``(m/n - 1) x W^T + (m/n) update`` with ``n``
        the row norms of ``W + s B A`` (constants), as peft computes it (``x W^T`` taken
        from the base output where dropout leaves the input as it is)."""
        weight = self.out_in_weight().to(out.dtype)
        delta = (self.lora_B.weight @ self.lora_A.weight).to(out.dtype) * self.scaling
        norm = torch.linalg.vector_norm(weight + delta.detach(), dim=1).detach()
        scale = self.lora_magnitude_vector.to(out.dtype) / norm
        if h is x:
            base = out if self.bias is None else out - self.bias
        else:
            base = F.linear(h.to(out.dtype), weight)
        return (scale - 1) * base + scale * update


class LoraLinear(LoraLayer, nn.Linear):
    """``nn.Linear`` with LoRA adapters."""


class LoraConv1D(LoraLayer, Conv1D):
    """transformers' ``Conv1D`` (GPT-2's projections: ``x W + b``, the weight [in, out]) with
    LoRA adapters, as peft adapts it (``fan_in_fan_out``): A and B as for a linear layer, the
    update ``(B A)^T`` in the weight's layout."""

    def out_in_weight(self) -> torch.Tensor:
        return dequantized(self.weight).t()

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.out_in_weight().to(x.dtype), self.bias)


ADAPTABLE = {nn.Linear: LoraLinear, Conv1D: LoraConv1D}  # a layer's class -> its adapted one


def fans(module: nn.Module) -> tuple[int, int]:
    """(inputs, outputs) of a linear layer or a ``Conv1D``."""
    if isinstance(module, Conv1D):
        return module.nx, module.nf
    return module.in_features, module.out_features


def add_lora(module: nn.Module, rank: int, alpha: float, dropout: float,
             dtype: torch.dtype, dora: bool = False) -> None:
    """Turn ``module`` (a plain ``nn.Linear`` or ``Conv1D``) into its adapted class in place:
    its weights keep their names and objects; the adapters are allocated where the weight is
    (the meta device under a sharded build) and filled by ``init_adapters``."""
    device = module.weight.device
    fan_in, fan_out = fans(module)
    module.__class__ = ADAPTABLE[type(module)]
    module.lora_A = nn.Linear(fan_in, rank, bias=False, device=device, dtype=dtype)
    module.lora_B = nn.Linear(rank, fan_out, bias=False, device=device, dtype=dtype)
    module.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    module.scaling = alpha / rank
    module.use_dora = dora
    if dora:
        module.lora_magnitude_vector = nn.Parameter(
            torch.empty(fan_out, device=device, dtype=dtype))


def is_adapter(name: str) -> bool:
    """A parameter name of an adapter (``...q_proj.lora_A.weight``,
    ``...q_proj.lora_magnitude_vector``)."""
    parts = name.split(".")
    return (parts[-1] == MAGNITUDE or parts[-1].endswith(EXPERT_SUFFIXES)
            or len(parts) >= 2 and parts[-2] in ADAPTER_CHILDREN)


def adapter_seed(seed: int, module_name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % (2**63)


def initial_a(name: str, shape: tuple, seed: int, init: str) -> torch.Tensor:
    """A's first value (float32, on the host), ``shape`` ``[..., rank, in]`` (a layer's, or
    every expert's of an experts weight), drawn from ``name``'s own seeded generator: kaiming
    as ``nn.Linear`` draws its weight (uniform within 1/sqrt(in)), gaussian from
    N(0, 1/rank)."""
    g = torch.Generator().manual_seed(adapter_seed(seed, name))
    rank, in_features = shape[-2:]
    if init == "gaussian":
        return torch.randn(shape, generator=g) / rank
    bound = 1.0 / math.sqrt(in_features)
    return torch.rand(shape, generator=g) * (2 * bound) - bound


def lora_modules(part: nn.Module) -> dict[str, LoraLayer]:
    """The adapted modules of a model (or a part of it) by name."""
    return {name: m for name, m in part.named_modules() if isinstance(m, LoraLayer)}
