"""Per-block torch.compile, in place: parameter names keep no ``_orig_mod.`` prefix."""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module, block_fqns: list[str]) -> None:
    # nn.Module.compile() compiles forward in place, unlike torch.compile(module) which wraps
    # the module in an OptimizedModule and prefixes every state-dict key.
    for fqn in block_fqns:
        model.get_submodule(fqn).compile()
