"""Image-text models (transformers' ``AutoModelForImageTextToText`` families: LLaVA, Qwen2-VL,
Gemma 3, ...): what automodel needs to know about them, read from the model itself.

- the family: a config with a ``vision_config`` is an image-text model;
- the text side: ``config.get_text_config()`` (vocabulary, sizes);
- images: the model's ``image_token_id`` marks where image features go in the token
  sequence; which image inputs the model takes, their shapes, and how many tokens one image
  fills are derived from its signatures and config (``models/image_inputs.py``);
- layer groups for freezing and scoped checkpointing: ``vision`` (the tower), ``multimodal``
  (the projector), ``language`` (the rest), from module names (``models/parts.py``).
"""

from __future__ import annotations

import fnmatch
import inspect

from torch import nn

from automodel.config.enums import LAYER_GROUPS
from automodel.models.parts import group_of


def is_image_text(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def text_overrides(config, keys: dict) -> dict:
    """``model.config`` entries that set ``keys`` on the language model's config: the keys
    themselves for a text model; for an image-text model its whole ``text_config`` with them
    (a composite config ignores text keys given at its top level)."""
    text = text_config(config)
    if text is config:
        return dict(keys)
    return {"text_config": {**text.to_dict(), **keys}}


def tower_cut(config, layers: int = 2) -> dict | None:
    """``model.config`` entries that cut the vision tower to ``layers`` encoder layers (more
    where ``vision_feature_layer`` reads a deeper one), or None where the tower is not cut:
    no tower, no ``num_hidden_layers`` in its config, or as shallow already."""
    vision = getattr(config, "vision_config", None)
    total = getattr(vision, "num_hidden_layers", None)
    if not isinstance(total, int):
        return None
    read = getattr(config, "vision_feature_layer", None)
    read = read if isinstance(read, (list, tuple)) else [] if read is None else [read]
    if not all(isinstance(i, int) for i in read):
        return None
    keep = max([layers] + [-i if i < 0 else i for i in read])
    if keep >= total:
        return None
    return {"vision_config": {**vision.to_dict(), "num_hidden_layers": keep}}


def auto_class(config):
    """The transformers auto class that builds this config's model for training."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM


def text_config(config):
    """The language model's config (the config itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def forward_inputs(model: nn.Module) -> set[str]:
    """The named inputs of the model's ``forward``."""
    return set(inspect.signature(model.forward).parameters)


# Inputs some families take beside the images, marking the image-token positions: Gemma 3's
# ``token_type_ids`` (image tokens attend to each other both ways), Qwen2-VL's
# ``mm_token_type_ids`` (image tokens get 3-D rotary positions).
IMAGE_TOKEN_MASKS = ("token_type_ids", "mm_token_type_ids")


def attends_images_both_ways(model: nn.Module) -> bool:
    """Whether the model's image tokens attend to each other both ways (it takes
    ``token_type_ids`` to mark them: Gemma 3, PaliGemma's prefix)."""
    return IMAGE_TOKEN_MASKS[0] in forward_inputs(model)


def adds_features_inside_layers(model: nn.Module) -> bool:
    """Whether the model adds image features inside its language layers, at the image
    positions (Qwen3-VL's deepstack: its language model takes ``visual_pos_masks``)."""
    from automodel.models.parts import block_fqns

    stack = language_stack(model, block_fqns(model))
    return stack is not None and "visual_pos_masks" in forward_inputs(
        model.get_submodule(stack))


def derives_positions(model: nn.Module) -> bool:
    """Whether the model computes its own (multi-axis rotary) positions from the image grid
    (Qwen2-VL families): the step must then pass no ``position_ids``."""
    return callable(getattr(getattr(model, "model", None), "get_rope_index", None))


def image_token_id(config) -> int:
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ValueError(f"{config.model_type}: the config has no image_token_id")
    return int(token)


def freeze(model: nn.Module, targets: list[str]) -> tuple[int, int]:
    """Freeze the parameters of ``targets``: layer groups (``vision``, ``multimodal``,
    ``language``, ``audio``) or parameter-name patterns (``fnmatch``, e.g.
    ``model.vision_tower.*``). Returns (frozen parameters, all parameters), as numbers of
    elements. A target matching nothing is an error naming it."""
    params = list(model.named_parameters())
    for target in targets:
        if target in LAYER_GROUPS:
            hit = [p for n, p in params if group_of(n) == target]
        else:
            hit = [p for n, p in params if fnmatch.fnmatchcase(n, target)]
        if not hit:
            raise ValueError(f"model.freeze: {target!r} matches no parameter of "
                             f"{type(model).__name__} (groups: {', '.join(LAYER_GROUPS)}; "
                             "or a parameter-name pattern such as 'model.vision_tower.*')")
        for p in hit:
            p.requires_grad_(False)
    frozen = sum(p.numel() for _, p in params if not p.requires_grad)
    return frozen, sum(p.numel() for _, p in params)


def language_stack(model: nn.Module, block_fqns: list[str]) -> str | None:
    """For an image-text model, the name of the module that runs its language blocks (the
    model's own ``get_decoder()``, e.g. ``model.language_model``; else the parent of the
    first language block's list); None for a text model."""
    if not is_image_text(model.config):
        return None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    named = next((n for n, m in model.named_modules() if m is decoder and n), None)
    if named is not None:
        return named
    language = [b for b in block_fqns if group_of(b) == "language"]
    return language[0].rsplit(".", 2)[0] if language else None
