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
import inspect

import torch
from torch import nn

from automodel.config.validate import LAYER_GROUPS
from automodel.models.parts import group_of


def is_image_text(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def auto_class(config):
    """The transformers auto class that builds this config's model for training."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM


def text_config(config):
    """The language model's config (the config itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def patch_sequence_images(config) -> bool:
    """Whether the model takes images as flattened patch sequences plus their grid sizes
    (``pixel_values`` [patches, C*T*P*P] and ``image_grid_thw``: the Qwen2-VL families) rather
    than fixed-size pixel arrays [1, C, H, W] (LLaVA, Gemma 3, ...)."""
    vc = config.vision_config
    return all(hasattr(vc, k) for k in ("spatial_merge_size", "temporal_patch_size"))


def synthetic_image(config, seed: int | None) -> dict[str, torch.Tensor]:
    """One image as the model's own inputs take it, of random pixels from ``seed`` (``None``: a
    blank image). Images of a batch are these inputs concatenated along dimension 0."""
    vc = config.vision_config
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def pixels(*shape):
        return torch.randn(*shape, generator=gen) if gen is not None else torch.zeros(*shape)

    if patch_sequence_images(config):
        side = 2 * vc.spatial_merge_size  # a grid of 2x2 merged patches: 4 image tokens
        channels = getattr(vc, "in_channels", None) or getattr(vc, "num_channels", 3)
        return {"pixel_values": pixels(side * side,
                                       channels * vc.temporal_patch_size * vc.patch_size ** 2),
                "image_grid_thw": torch.tensor([[1, side, side]])}
    size = vc.image_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return {"pixel_values": pixels(1, getattr(vc, "num_channels", 3), height, width)}


@torch.no_grad()
def tokens_per_image(meta_model: nn.Module, image: dict[str, torch.Tensor]) -> int:
    """How many image-token positions one image (its model inputs) fills: for patch sequences
    the merged grid (patches / merge_size**2), otherwise the length of the features the model's
    own ``get_image_features`` gives for it, run on the meta device (no weights, no memory)."""
    config = meta_model.config
    if patch_sequence_images(config):
        return int(image["image_grid_thw"].prod()) // config.vision_config.spatial_merge_size ** 2
    out = meta_model.model.get_image_features(
        **{k: v.to("meta") if k == "pixel_values" else v for k, v in image.items()})
    features = getattr(out, "pooler_output", out)
    first = features[0] if isinstance(features, (list, tuple)) else features.flatten(0, -2)
    return int(first.shape[0])


def forward_inputs(model: nn.Module) -> set[str]:
    """The named inputs of the model's ``forward``."""
    return set(inspect.signature(model.forward).parameters)


# Inputs some families take beside the images, marking the image-token positions: Gemma 3's
# ``token_type_ids`` (image tokens attend to each other both ways), Qwen2-VL's
# ``mm_token_type_ids`` (image tokens get 3-D rotary positions).
IMAGE_TOKEN_MASKS = ("token_type_ids", "mm_token_type_ids")


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
