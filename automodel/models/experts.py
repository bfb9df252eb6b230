"""Where a mixture-of-experts model keeps its experts, from the model's own metadata.

transformers keeps each MoE layer's experts as fused 3-D parameters ``[num_experts, ...]`` in
one module, and names those modules in the config's ``base_model_ep_plan`` (style
``ep_dispatch_experts``; the weights are styled ``grouped_gemm``).
"""

from __future__ import annotations

import re

from torch import nn

DISPATCH_STYLE = "ep_dispatch_experts"


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules of ``model`` (a whole model or a pipeline stage) by name (an
    image-text model's plan is its language model's: ``text_config``)."""
    from automodel.models.multimodal import text_config

    config = getattr(model, "config", None)
    plan = (getattr(config, "base_model_ep_plan", None)
            or getattr(text_config(config), "base_model_ep_plan", None) or {}) \
        if config is not None else {}
    patterns = [re.compile(r"(^|\.)" + re.escape(p).replace(r"\*", r"\d+") + "$")
                for p, style in plan.items() if style == DISPATCH_STYLE]
    if not patterns:
        return {}
    return {name: m for name, m in model.named_modules()
            if name and any(p.search(name) for p in patterns)}


def is_moe(model: nn.Module) -> bool:
    return bool(expert_modules(model))
