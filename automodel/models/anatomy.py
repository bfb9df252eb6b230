"""Where a causal LM keeps the parts a pipeline split places: the token embedding, the
decoder-layer list, the modules that run before the layers (learned positions, an embedding
norm, dropout) and after them (the final norm, an output projection), and the LM head.

Read from the model itself. The *stack* is the module that holds the layer list (the list of
``_no_split_modules`` blocks): the base model (``model``, ``transformer``) or a module inside
it (OPT's ``model.decoder``). Its other children are ordered by the stack's own description
of its forward, Hugging Face's ``base_model_pp_plan`` where the config has one, else the
order in which the stack's ``forward`` first names them (``self.wpe`` before ``self.h``,
``self.ln_f`` after). What runs before the layers belongs on the first stage, what runs after
on the last. A module with parameters that neither names is refused, naming it.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn

from automodel.models.parts import block_class_names


class AnatomyError(ValueError):
    """The model's parts cannot be found or placed; the message names what is missing."""


@dataclass(frozen=True)
class Anatomy:
    base: str  # attribute of the causal LM holding the base model (its base_model_prefix)
    stack: str  # FQN (in the causal LM) of the module holding the layer list
    embed: str  # child of the stack: the token embedding
    layers: str  # child of the stack: the decoder layers (a ModuleList)
    before: tuple  # children of the stack with parameters that run before the layers
    after: tuple  # ... and after them (the final norm, an output projection)
    head: str  # FQN of the LM head in the causal LM
    num_layers: int
    source: str  # "base_model_pp_plan" or "forward" (the stack's forward's source)
    # FQNs (in the causal LM) of modules beside the stack that run before it, on the first
    # stage: an image-text model's vision tower and projector (the stack is its language model)
    front: tuple = ()

    def fqn(self, child: str) -> str:
        return f"{self.stack}.{child}"

    @property
    def norm(self) -> str | None:
        """The final norm: the last module after the layers (None: nothing runs there)."""
        return self.after[-1] if self.after else None


def _family(model: nn.Module) -> str:
    return f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r})"


def has_params(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def _child_name(parent: nn.Module, target: nn.Module | None) -> str | None:
    return next((n for n, m in parent.named_children() if m is target), None)


def find_anatomy(model: nn.Module) -> Anatomy:
    family = _family(model)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module):
        raise AnatomyError(f"pipeline split of {family}: no base model at "
                           f"base_model_prefix={prefix!r}")
    head = _child_name(model, model.get_output_embeddings())
    if head is None:
        raise AnatomyError(f"pipeline split of {family}: no LM head (get_output_embeddings() is "
                           "not a direct child of the model)")
    language = _language_model(model)
    stack_fqn, layers = _find_layers(model, language or prefix, family)
    stack = model.get_submodule(stack_fqn)
    embed = _child_name(stack, model.get_input_embeddings())
    if embed is None:
        raise AnatomyError(f"pipeline split of {family}: the token embedding "
                           f"(get_input_embeddings()) is not a child of {stack_fqn!r}, which holds "
                           f"the layers {layers!r}")
    plan = getattr(model.config, "base_model_pp_plan", None) if stack is base else None
    order, source = (list(plan), "base_model_pp_plan") if plan else ([], "forward")
    order += [n for n in _forward_order(stack) if n not in order]
    if layers not in order:
        raise AnatomyError(f"pipeline split of {family}: the forward of {type(stack).__name__} "
                           f"never names its layer list {layers!r}")
    i = order.index(layers)
    named = {n: m for n, m in stack.named_children()}
    before = tuple(n for n in order[:i] if n != embed and n in named and has_params(named[n]))
    after = tuple(n for n in order[i + 1:] if n in named and has_params(named[n]))
    if embed not in order[:i]:
        raise AnatomyError(f"pipeline split of {family}: the token embedding {embed!r} does not "
                           f"run before the layers {layers!r}")
    placed = {embed, layers, *before, *after}
    stray = [f"{stack_fqn}.{n}" for n, m in named.items() if n not in placed and has_params(m)]
    beside = _stray_on_path(model, stack_fqn, head)
    front = tuple(n for n in beside if language and n.startswith(prefix + "."))
    stray += [n for n in beside if n not in front]
    if stray:
        raise AnatomyError(
            f"pipeline split of {family}: {', '.join(stray)} hold parameters but run neither "
            f"before nor after the layer list {stack_fqn}.{layers} (as far as the forward of "
            f"{type(stack).__name__} shows), nor are they the LM head {head!r}; the stages "
            "cannot place them (use pipeline=none)")
    return Anatomy(prefix, stack_fqn, embed, layers, before, after, head,
                   len(getattr(stack, layers)), source, front)


def _language_model(model: nn.Module) -> str | None:
    """An image-text model's language model (the stack its stages split; the tower and the
    projector beside it go to the first stage); None for a text model."""
    from automodel.models.multimodal import is_image_text, language_stack
    from automodel.models.parts import block_fqns

    return language_stack(model, block_fqns(model)) if is_image_text(model.config) else None


def _find_layers(model: nn.Module, prefix: str, family: str) -> tuple[str, str]:
    """(FQN of the stack, name of its layer list): the one ModuleList of blocks in the base
    model (in an image-text model's language model: ``prefix``)."""
    blocks = block_class_names(model)
    found = [n for n, m in model.get_submodule(prefix).named_modules(prefix=prefix)
             if isinstance(m, nn.ModuleList) and len(m) and type(m[0]).__name__ in blocks]
    outer = [n for n in found if not any(n.startswith(o + ".") for o in found if o != n)]
    if len(outer) != 1:
        raise AnatomyError(f"pipeline split of {family}: the model has no single list of decoder "
                           f"layers of class {sorted(blocks) or '?'} (found {outer or 'none'})")
    stack, _, layers = outer[0].rpartition(".")
    return stack, layers


def _forward_order(stack: nn.Module) -> list[str]:
    """The stack's children in the order its forward first names them (``self.<child>``);
    children it never names are left out."""
    try:
        source = inspect.getsource(type(stack).forward)
    except (OSError, TypeError):
        return []
    first = {}
    for name, _ in stack.named_children():
        hit = re.search(rf"self\.{re.escape(name)}\b", source)
        if hit is not None:
            first[name] = hit.start()
    return sorted(first, key=first.get)


def _stray_on_path(model: nn.Module, stack_fqn: str, head: str) -> list[str]:
    """Modules with parameters beside the path from the causal LM to the stack (other than
    the head): no stage would hold them."""
    stray, parent, path = [], model, ""
    for part in stack_fqn.split("."):
        for n, m in parent.named_children():
            if n != part and not (parent is model and n == head) and has_params(m):
                stray.append(f"{path}{n}" if path else f"(causal LM) {n}")
        parent, path = getattr(parent, part), f"{path}{part}."
    return stray
