"""Where the transformer blocks and layer groups of a model are (by FQN)."""

from __future__ import annotations

from torch import nn

_VISION_HINTS = ("vision", "visual", "image", "video")
_AUDIO_HINTS = ("audio", "speech")
_PROJECTOR_HINTS = ("projector", "multi_modal", "multimodal", "merger", "connector", "aligner",
                    "vision_projection", "embeddings_table")


def block_class_names(model: nn.Module) -> set[str]:
    """The classes of the model's transformer blocks: its ``_no_split_modules``, else (older
    families declare none) the classes of the items of its layer lists (modules whose
    children are named 0, 1, ...) whose items all share one class and hold parameters."""
    names = getattr(model, "_no_split_modules", None) or ()
    return set(names) or structural_block_classes(model)


def structural_block_classes(model: nn.Module) -> set[str]:
    classes = set()
    for module in model.modules():
        items = dict(module.named_children())  # a list: children named 0, 1, ... (also a
        if items and all(k.isdigit() for k in items):  # pipeline stage's share of one)
            kinds = {type(item) for item in items.values()}
            if len(kinds) == 1 and any(True for _ in module.parameters()):
                classes.add(kinds.pop().__name__)
    return classes


def block_fqns(model: nn.Module) -> list[str]:
    """FQNs of the transformer blocks (``block_class_names``), in forward order."""
    classes = block_class_names(model)
    if not classes:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules and holds no "
                         "list of layers of one class: cannot find its transformer blocks")
    found = [name for name, mod in model.named_modules()
             if type(mod).__name__ in classes and name]
    # keep outermost blocks only (a block class nested in another block is part of it)
    outer = [n for n in found if not any(n.startswith(o + ".") for o in found if o != n)]
    if not outer:
        raise ValueError(f"no module of class {sorted(classes)} found in {type(model).__name__}")
    # a module sharing a weight with one outside it (an embedding tied to the LM head: BERT
    # lists its embeddings among _no_split_modules) is no block: FSDP2 cannot shard one
    # parameter in two units, nor can a checkpointed block own what others use
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [b for b in outer if all(n.startswith(b + ".") for p in
                                    model.get_submodule(b).parameters() for n in names[id(p)])]


def group_of(fqn: str) -> str:
    """The layer group of a module or parameter name (from name hints)."""
    lowered = fqn.lower()
    if any(h in lowered for h in _PROJECTOR_HINTS):  # first: Qwen2-VL's projector is
        return "multimodal"  # model.visual.merger
    if any(h in lowered for h in _VISION_HINTS):
        return "vision"
    if any(h in lowered for h in _AUDIO_HINTS):
        return "audio"
    return "language"


def layer_groups(model: nn.Module) -> dict[str, list[str]]:
    """Blocks by group: {"language": [...], "vision": [...], ...}; only non-empty groups."""
    groups: dict[str, list[str]] = {}
    for fqn in block_fqns(model):
        groups.setdefault(group_of(fqn), []).append(fqn)
    return groups


def vision_tower(model: nn.Module) -> str | None:
    """FQN of the module holding the vision blocks (``model.vision_tower``,
    ``model.visual``): their closest common ancestor, widened while its parent is still named
    as vision. None for a model without vision blocks."""
    blocks = layer_groups(model).get("vision")
    if not blocks:
        return None
    common = blocks[0].split(".")
    for fqn in blocks[1:]:
        parts = fqn.split(".")
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    if len(blocks) == 1:
        common = common[:-1]  # the block's parent, not the block itself
    while len(common) > 1 and group_of(".".join(common[:-1])) == "vision":
        common = common[:-1]
    return ".".join(common) or None


def select_blocks(model: nn.Module, scope: list[str], trainable_only: bool = True) -> list[str]:
    """Blocks in the given scope (["all"] or group names); scoped groups keep trainable blocks."""
    if scope == ["all"]:
        return block_fqns(model)
    groups = layer_groups(model)
    missing = [g for g in scope if g not in groups]
    if missing:
        raise ValueError(f"activation_checkpointing_scope={scope}: {type(model).__name__} has no "
                         f"{', '.join(missing)} layers (its groups: {', '.join(groups)})")
    chosen = [f for g in scope for f in groups[g]]
    if trainable_only:
        chosen = [f for f in chosen
                  if any(p.requires_grad for p in model.get_submodule(f).parameters())]
    return chosen


def replace_module(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent.register_module(child, new)
