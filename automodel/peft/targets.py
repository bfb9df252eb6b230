"""Which linear layers get adapters (``peft.target_modules`` / ``exclude_modules``), and the
refusals that need the model: checked on the meta model before launch, and applied the same
way on every rank.

- null (the default): the attention and MLP projections, i.e. the linear layers inside the
  language model's blocks, MoE routers and gates left out;
- ``[all-linear]``: every linear layer of the language model except the LM head;
- patterns: ``fnmatch`` on module names, also matching a name's tail (``q_proj`` and
  ``*.q_proj`` both take every ``...q_proj``), anywhere in the model (a vision tower too).
"""

from __future__ import annotations

import difflib
import fnmatch

from torch import nn

from automodel.config import schema as s
from automodel.config.enums import LAYER_GROUPS
from automodel.config.validate_peft import ALL_LINEAR
from automodel.models.experts import expert_modules
from automodel.models.parts import group_of, layer_groups
from automodel.peft.lora import ADAPTABLE, fans


class AdapterError(ValueError):
    """``peft`` asks for adapters the model cannot take."""


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    """The layers LoRA can adapt: linear layers, and transformers' ``Conv1D`` (GPT-2's)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, tuple(ADAPTABLE))}


def _head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is head), None)


def _routers(model: nn.Module) -> set[str]:
    """The linear layers a MoE layer holds beside its experts: its router (one logit per
    expert) and gates such as Qwen2-MoE's shared-expert gate (one logit): they choose, they do
    not project. (A shared expert is a module of its own, with projections.)"""
    parents = {name.rpartition(".")[0] for name in expert_modules(model)}
    return {n for n in _linears(model) if n.rpartition(".")[0] in parents}


def _default(model: nn.Module, linears: dict) -> list[str]:
    blocks = layer_groups(model).get("language", [])
    routers = _routers(model)
    return [n for n in linears if n not in routers
            and any(n.startswith(b + ".") for b in blocks)]


def _by_patterns(model: nn.Module, linears: dict, patterns: list[str]) -> list[str]:
    chosen = []
    for pattern in patterns:
        hit = [n for n in linears if _matches(n, pattern)]
        if not hit:
            raise AdapterError(_no_match(model, linears, pattern))
        chosen += [n for n in hit if n not in chosen]
    return chosen


def _no_match(model: nn.Module, linears: dict, pattern: str) -> str:
    others = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
              if n and n not in linears and _matches(n, pattern)]
    if others:
        return (f"peft.target_modules: {pattern!r} matches {', '.join(others[:3])}"
                f"{' ...' if len(others) > 3 else ''}, not a linear layer: LoRA adapts "
                "nn.Linear and Conv1D layers (embeddings take none; MoE experts' fused weights "
                "take theirs "
                "with peft.experts=true)")
    tails = sorted({".".join(n.split(".")[-2:]) for n in linears}
                   | {n.rpartition(".")[2] for n in linears})
    close = difflib.get_close_matches(pattern.lstrip("*."), tails, n=3, cutoff=0.5)
    return (f"peft.target_modules: {pattern!r} matches no linear layer of "
            f"{type(model).__name__}" + (f"; nearest names: {', '.join(close)}" if close else "")
            + f" (patterns are fnmatch on module names, e.g. '*.q_proj'; or [{ALL_LINEAR}])")


def adapter_targets(model: nn.Module, peft: s.PeftConfig, loss: str = "auto",
                    freeze: tuple = ()) -> list[str]:
    """The names of the linear layers ``peft`` puts adapters on; ``AdapterError`` for what
    the model cannot take."""
    linears = _linears(model)
    head = _head_name(model)
    if peft.target_modules is None:
        chosen = _default(model, linears)
    elif peft.target_modules == [ALL_LINEAR]:
        chosen = [n for n in linears if n != head and group_of(n) == "language"]
    else:
        chosen = _by_patterns(model, linears, list(peft.target_modules))
    dropped = [n for n in chosen if any(_matches(n, p) for p in peft.exclude_modules)]
    unused = [p for p in peft.exclude_modules if not any(_matches(n, p) for n in chosen)]
    if unused:
        raise AdapterError(f"peft.exclude_modules: {unused[0]!r} takes out none of the "
                           f"{len(chosen)} targeted layers (e.g. {chosen[0] if chosen else '-'})")
    chosen = [n for n in chosen if n not in dropped]
    if peft.experts:
        _check_experts(model, peft)
    if not chosen:
        raise AdapterError("peft: no linear layer is left to adapt (peft.exclude_modules "
                           "took out every targeted one)")
    _check_chosen(model, linears, chosen, head, peft, loss, freeze)
    return chosen


def _check_experts(model: nn.Module, peft: s.PeftConfig) -> None:
    from automodel.peft.experts import expert_weights, in_out

    found = expert_modules(model)
    if not found:
        raise AdapterError(f"peft.experts=true: {type(model).__name__} has no MoE experts (no "
                           "experts module in its config's base_model_ep_plan); set "
                           "peft.experts=false")
    for name, module in found.items():
        weights = expert_weights(module)
        if weights is None:
            raise AdapterError(f"peft.experts=true: {name} ({type(module).__name__}) is not an "
                               "experts module automodel knows (fused per-expert 3-D weights "
                               "made by transformers' experts interface); set "
                               "peft.experts=false")
        for weight in weights:
            fan_in, fan_out = in_out(module, weight)
            if peft.rank > min(fan_in, fan_out):
                raise AdapterError(f"peft.rank={peft.rank} is wider than the experts' "
                                   f"{name}.{weight} ({fan_in} -> {fan_out}): at most "
                                   f"{min(fan_in, fan_out)}")


def _check_chosen(model, linears, chosen, head, peft, loss, freeze) -> None:
    if head in chosen and loss != "plain":
        raise AdapterError(f"peft.target_modules takes the LM head {head!r}: the fused loss "
                           "(trainer.loss=auto or fused) computes the logits from the head's "
                           "weight directly and would skip its adapters; leave the head out "
                           "(peft.exclude_modules=[" + head + "]) or set trainer.loss=plain")
    for n in chosen:
        m = linears[n]
        plain = next(c for c in ADAPTABLE if isinstance(m, c))
        if type(m).forward is not plain.forward:
            raise AdapterError(f"peft: {n} is a {type(m).__name__}, a {plain.__name__} with a "
                               "forward of its own; LoRA adapts plain nn.Linear and Conv1D "
                               "layers: take it out with peft.exclude_modules")
        fan_in, fan_out = fans(m)
        if peft.rank > min(fan_in, fan_out):
            raise AdapterError(f"peft.rank={peft.rank} is wider than {n} "
                               f"({fan_in} -> {fan_out}): at most {min(fan_in, fan_out)}")
    for target in freeze:
        hit = [n for n in chosen if (group_of(n) == target if target in LAYER_GROUPS
                                     else fnmatch.fnmatchcase(n + ".weight", target))]
        if hit:
            raise AdapterError(f"model.freeze={list(freeze)} and peft: {target!r} freezes "
                               f"{hit[0]}, which peft gives adapters to train (with peft every "
                               "base weight is frozen already): take the module out with "
                               f"peft.exclude_modules, or drop {target!r} from model.freeze")
