"""Which tensor-parallel plan a model gets: the user's, the model's own Hugging Face plan, or
a fallback for Llama-style module names. Plans map FQN patterns (``*`` = one path component)
to style names; ``automodel/distributed/tensor_parallel.py`` turns them into torch styles.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from torch import nn

from automodel.compat import input_embeddings
from automodel.imports import load_object
from automodel.models.experts import expert_modules

# For models without a Hugging Face plan whose modules follow Llama's names.
LLAMA_STYLE_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}


def load_plan_from_path(path: str, model: nn.Module) -> dict:
    """``pkg.module.NAME``: a dict, or a function returning one (given the model if it takes
    an argument)."""
    obj = load_object(path, "parallelism.tp_plan")
    if callable(obj):
        obj = obj(model) if inspect.signature(obj).parameters else obj()
    if not isinstance(obj, dict):
        raise ValueError(f"parallelism.tp_plan={path!r} gave a {type(obj).__name__}, "
                         "expected a dict of FQN pattern -> style name")
    return obj


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part)
                                  for part in pattern.split(".")) + "$")


def matches(model: nn.Module, pattern: str) -> list[str]:
    """FQNs the pattern names: modules, else bare parameters; tried as given, then under the
    base model's prefix."""
    modules = [n for n, _ in model.named_modules() if n]
    prefix = getattr(model, "base_model_prefix", "")
    for candidate in [pattern] + ([f"{prefix}.{pattern}"] if prefix else []):
        regex = _pattern_regex(candidate)
        found = [n for n in modules if regex.match(n)] or [
            n for n, _ in model.named_parameters() if regex.match(n)]
        if found:
            return found
    return []


def _hf_plan(model: nn.Module) -> dict | None:
    """The model's own plan. A family's plan covers all its variants (e.g. MiniCPM3 with and
    without a low-rank q projection): entries matching nothing in this model are dropped.
    So are entries for the experts of a mixture-of-experts model: they stay whole on every TP
    rank (TP ranks see the same tokens), and expert parallelism splits them instead."""
    full = _full_hf_plan(model)
    if full is None:
        return None
    experts = tuple(expert_modules(model))
    return {pattern: style for pattern, style in full.items()
            if (found := matches(model, pattern))
            and not all(_inside(name, experts) for name in found)}


def _inside(name: str, modules: tuple) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def _full_hf_plan(model: nn.Module) -> dict | None:
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    base_plan = getattr(model.config, "base_model_tp_plan", None)
    if base_plan:
        prefix = getattr(model, "base_model_prefix", "")
        full = {f"{prefix}.{k}" if prefix else k: v for k, v in base_plan.items()}
        if input_embeddings(model) is not None:
            name = _fqn_of(model, input_embeddings(model))
            full.setdefault(name, "embedding_rowwise")
        if model.get_output_embeddings() is not None:
            full.setdefault(_fqn_of(model, model.get_output_embeddings()), "colwise_gather_output")
        return full
    return None


def _fqn_of(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, mod in model.named_modules() if mod is target)


def select_tp_plan(model: nn.Module, user_plan: Any, vision_tp: str = "whole",
                   tp: int = 1) -> tuple[dict, str]:
    """(plan, where it came from); ``vision_tp=heads``: with an image-text model's tower split
    ``tp`` ways by heads (``models/vision_tp.py``)."""
    plan, source = _selected(model, user_plan)
    if vision_tp == "heads":
        from automodel.models.vision_tp import vision_plan

        plan = {**plan, **vision_plan(model, tp)}
        source += " and the vision tower's by heads (parallelism.multimodal.vision.tp)"
    return plan, source


def _selected(model: nn.Module, user_plan: Any) -> tuple[dict, str]:
    if isinstance(user_plan, dict):
        return dict(user_plan), "parallelism.tp_plan"
    if isinstance(user_plan, str):
        return load_plan_from_path(user_plan, model), f"parallelism.tp_plan={user_plan}"
    plan = _hf_plan(model)
    if plan is not None:
        return plan, f"{type(model).__name__}'s Hugging Face plan"
    return dict(LLAMA_STYLE_PLAN), "the Llama-style fallback plan"


def vision_tp(options) -> str:
    """``parallelism.multimodal.vision.tp`` of a strategy's options ("whole" where it has
    none)."""
    multimodal = getattr(options, "multimodal", None)
    return str(getattr(getattr(multimodal, "vision", None), "tp", "whole"))
