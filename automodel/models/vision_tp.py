"""A tensor-parallel plan for an image-text model's vision tower
(``parallelism.multimodal.vision.tp=heads``), made from the tower's own blocks.

The families' Hugging Face plans split only the language model; by default the tower stays
whole on every TP rank. This plan splits each tower block as the language blocks are split:
its attention by heads (query, key and value projections by output, ``colwise``; the output
projection by input, ``rowwise``) and its MLP by the hidden size (the first projections
``colwise``, the last ``rowwise``). A block's linear layers are told apart by their names
(``q_proj`` / ``query``, ``out_proj`` / ``proj``, ``fc1`` / ``up_proj``, ...); a block
holding another linear layer (a fused ``qkv`` projection: Qwen2-VL's tower) cannot be split
this way and is refused, naming it, as are sizes TP does not divide. The tower then takes the
whole images on every TP rank (replicated in, reduced out: no sequence parallelism inside it).
"""

from __future__ import annotations

from torch import nn

from automodel.models.parts import block_fqns, group_of

COLWISE = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "fc1", "gate_proj",
           "up_proj", "linear_fc1")
ROWWISE = ("out_proj", "o_proj", "proj", "projection_layer", "dense", "fc2", "down_proj",
           "linear_fc2")


def vision_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """{pattern of a tower block's linear layer (``*`` for the block's index): style}; a
    ``ValueError`` naming what cannot be split ``tp`` ways."""
    family = type(model).__name__
    blocks = [b for b in block_fqns(model)  # (the tower's list of layers: not its embedding)
              if group_of(b) == "vision" and b.rsplit(".", 1)[-1].isdigit()]
    if not blocks:
        raise ValueError(f"parallelism.multimodal.vision.tp=heads: {family} has no vision "
                         "tower blocks to split")
    vc = model.config.vision_config
    heads = getattr(vc, "num_attention_heads", None) or getattr(vc, "num_heads", None)
    if not isinstance(heads, int) or heads % tp:
        raise ValueError(f"parallelism.multimodal.vision.tp=heads: mesh.tp_size={tp} must divide "
                         f"the tower's attention heads ({heads}, vision_config of {family}); "
                         "use parallelism.multimodal.vision.tp=whole")
    first = blocks[0]
    prefix = first.rsplit(".", 1)[0] + ".*"
    plan = {}
    for name, module in model.get_submodule(first).named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        style = "colwise" if leaf in COLWISE else "rowwise" if leaf in ROWWISE else None
        if style is None:
            raise ValueError(f"parallelism.multimodal.vision.tp=heads: {first}.{name} "
                             f"({module.in_features} -> {module.out_features}) is neither an "
                             "input projection nor an output projection of its attention or "
                             "MLP by name (a fused query/key/value projection cannot be split "
                             "by heads this way); use parallelism.multimodal.vision.tp=whole")
        size = module.out_features if style == "colwise" else module.in_features
        if size % tp:
            raise ValueError(f"parallelism.multimodal.vision.tp=heads: mesh.tp_size={tp} must "
                             f"divide {first}.{name}'s {size} {style} features; use "
                             "parallelism.multimodal.vision.tp=whole")
        plan[f"{prefix}.{name}"] = style
    if not plan:
        raise ValueError(f"parallelism.multimodal.vision.tp=heads: {first} holds no linear "
                         "layers to split; use parallelism.multimodal.vision.tp=whole")
    return plan
