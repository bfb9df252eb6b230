"""Image-text models (transformers' ``AutoModelForImageTextToText`` families: LLaVA, Qwen2-VL,
Gemma 3, ...): what automodel needs to know about them, read from the model itself.

- the family: a config with a ``vision_config`` is an image-text model;
- the text side: ``config.get_text_config()`` (vocabulary, sizes);
- images: the model's ``image_token_id`` marks where image features go in the token
  sequence, and how many tokens one image takes is what the model's own
  ``get_image_features`` returns for an image of its configured size (computed on the meta
  device: no weights, no memory);
- layer groups for freezing and scoped checkpointing: ``vision`` (the tower), ``multimodal``
  (the projector), ``language`` (the rest), from module names (``models/parts.py``).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from automodel.models.parts import LAYER_GROUPS, group_of


def is_image_text(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def auto_class(config):
    """The transformers auto class that builds this config's model for training."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM


def text_config(config):
    """The language model's config (the config itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def image_shape(config) -> tuple[int, int, int]:
    """(channels, height, width) of one image as the vision tower expects it."""
    vc = config.vision_config
    size = vc.image_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return getattr(vc, "num_channels", 3), height, width


@torch.no_grad()
def tokens_per_image(meta_model: nn.Module) -> int:
    """How many image-token positions one image fills: the length of the features the model's
    own ``get_image_features`` gives for one image (run on the meta device)."""
    pixels = torch.empty(1, *image_shape(meta_model.config), device="meta")
    out = meta_model.model.get_image_features(pixel_values=pixels)
    features = getattr(out, "pooler_output", out)
    first = features[0] if isinstance(features, (list, tuple)) else features.flatten(0, -2)
    return int(first.shape[0])


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
