"""Where a causal LM keeps the parts a pipeline split places: token embedding, decoder-layer
list, final norm and LM head.

Read from the model itself: Hugging Face configs carry ``base_model_pp_plan`` (the base
model's children in forward order: embedding, optional dropout, layers, final norm); models
without one are searched (the input embeddings, the list holding the ``_no_split_modules``
blocks, a norm child). A model whose base has other children with parameters cannot be split
into stages and is refused, naming them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from automodel.models.parts import block_class_names


class AnatomyError(ValueError):
    """The model's parts cannot be found or placed; the message names what is missing."""


@dataclass(frozen=True)
class Anatomy:
    base: str  # attribute of the causal LM holding the base model (its base_model_prefix)
    embed: str  # child of the base model: the token embedding
    layers: str  # child of the base model: the decoder layers (a ModuleList)
    norm: str | None  # child of the base model: the final norm (None: the model has none)
    head: str  # FQN of the LM head in the causal LM
    num_layers: int
    source: str  # "base_model_pp_plan" or "search"

    def fqn(self, child: str) -> str:
        return f"{self.base}.{child}"


def _family(model: nn.Module) -> str:
    return f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r})"


def _has_params(module: nn.Module | None) -> bool:
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
    head_module = model.get_output_embeddings()
    head = _child_name(model, head_module)
    if head is None:
        raise AnatomyError(f"pipeline split of {family}: no LM head (get_output_embeddings() is "
                           "not a direct child of the model)")
    plan = getattr(model.config, "base_model_pp_plan", None)
    if plan:
        embed, layers, norm, passive = _from_plan(base, dict(plan), family)
        source = "base_model_pp_plan"
    else:
        embed, layers, norm, passive = _by_search(model, base, family)
        source = "search"
    placed = {embed, layers, norm, *passive} - {None}
    stray = [n for n, m in base.named_children() if n not in placed and _has_params(m)]
    stray += [f"(causal LM) {n}" for n, m in model.named_children()
              if n not in (prefix, head) and _has_params(m)]
    if stray:
        raise AnatomyError(
            f"pipeline split of {family}: {', '.join(stray)} hold parameters but are neither the "
            f"embedding {embed!r}, the layer list {layers!r}, the final norm {norm!r} nor the "
            f"LM head {head!r}; the stages cannot place them (use pipeline=none)")
    return Anatomy(prefix, embed, layers, norm, head, len(getattr(base, layers)), source)


def _from_plan(base: nn.Module, plan: dict, family: str):
    names = list(plan)
    missing = [n for n in names if not isinstance(getattr(base, n, None), nn.Module)]
    if missing:
        raise AnatomyError(f"pipeline split of {family}: base_model_pp_plan names "
                           f"{', '.join(missing)}, which the model does not have")
    layers = [n for n in names if isinstance(getattr(base, n), nn.ModuleList)]
    if len(layers) != 1:
        raise AnatomyError(f"pipeline split of {family}: base_model_pp_plan must name exactly one "
                           f"layer list, found {layers or 'none'} in {names}")
    [layers_name] = layers
    i = names.index(layers_name)
    before, after = names[:i], names[i + 1:]
    embeds = [n for n in before if "input_ids" in plan[n][0]]
    if len(embeds) != 1:
        raise AnatomyError(f"pipeline split of {family}: base_model_pp_plan has no single "
                           f"embedding (a part taking input_ids) before {layers_name!r}")
    [embed] = embeds
    norms = [n for n in after if _has_params(getattr(base, n))]
    if len(norms) > 1:
        raise AnatomyError(f"pipeline split of {family}: base_model_pp_plan has several parts "
                           f"with parameters after the layers ({', '.join(norms)})")
    passive = [n for n in before + after if n != embed and n not in norms]
    with_params = [n for n in passive if _has_params(getattr(base, n))]
    if with_params:
        raise AnatomyError(f"pipeline split of {family}: base_model_pp_plan places "
                           f"{', '.join(with_params)} (with parameters) between the embedding and "
                           "the layers")
    return embed, layers_name, (norms[0] if norms else None), passive


def _by_search(model: nn.Module, base: nn.Module, family: str):
    embed = _child_name(base, model.get_input_embeddings())
    blocks = block_class_names(model)
    layer_lists = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList)
                   and len(m) and type(m[0]).__name__ in blocks]
    norms = [n for n, m in base.named_children()
             if "norm" in type(m).__name__.lower() and _has_params(m)]
    missing = []
    if embed is None:
        missing.append("the token embedding (get_input_embeddings() as a child of the base "
                       "model)")
    if len(layer_lists) != 1:
        missing.append(f"one list of decoder layers of class {sorted(blocks) or '?'} "
                       f"(found {layer_lists or 'none'})")
    if len(norms) > 1:
        missing.append(f"a single final norm (found {', '.join(norms)})")
    if missing:
        raise AnatomyError(f"pipeline split of {family}: the config has no base_model_pp_plan and "
                           f"the model has no {'; no '.join(missing)}")
    return embed, layer_lists[0], (norms[0] if norms else None), []
