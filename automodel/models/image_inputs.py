"""How one image-text model takes its images, derived from its own signatures and config.

A family's processor hands the model ``pixel_values`` and, depending on the family, more
image inputs. Which ones a model takes is read from its ``forward`` and
``get_image_features`` signatures; their shapes from its config and its modeling module:

- patch sequences with grid sizes (``image_grid_thw``: Qwen2-VL, GLM-4V, ...):
  ``pixel_values`` [patches, C*T*P*P], ``image_grid_thw`` [1, 3];
- fixed-size pixel arrays [1, C, H, W] (``vision_config.image_size``), and where the
  model takes them:
  - ``image_sizes`` [1, 2] (the image's height and width: LLaVA-NeXT, Mistral 3, ...);
  - several crops per image (a config with ``image_grid_pinpoints``: LLaVA-NeXT,
    LLaVA-OneVision): [1, crops, C, H, W], the number of crops from the module's own
    ``image_size_to_num_patches``;
  - a patch attention mask (``pixel_attention_mask``: Idefics 2/3, SmolVLM): images per
    sample [1, 1, C, H, W] and the mask [1, 1, H, W].

How many image tokens one image fills is what the model's own ``get_image_features`` returns
for it, run on the meta device. A model whose image inputs cannot be derived this way is
refused with a ``ValueError`` naming what is missing (``image_spec``).
"""

from __future__ import annotations

import inspect
import sys
from copy import deepcopy
from dataclasses import dataclass

import torch
from torch import nn

from automodel.compat import direct_parameters, set_parameter

# Inputs built here; any other ``get_image_features`` input without a default is missing.
KNOWN = {"pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask"}


@dataclass(frozen=True)
class ImageSpec:
    """One image as the model takes it."""

    channels: int
    height: int = 0  # pixel arrays
    width: int = 0
    crops: int = 0  # >0: [1, crops, C, H, W] (several crops per image)
    sizes: bool = False  # pass image_sizes
    patch_mask: bool = False  # pass pixel_attention_mask ([1, 1, C, H, W] images)
    patch_dim: int = 0  # >0: patch sequences [patches, patch_dim] with image_grid_thw
    merge: int = 1  # patch sequences: patches merged per side into one token


def image_features_fn(model: nn.Module):
    """The model's ``get_image_features`` (on the model or its base), or None."""
    fn = getattr(model, "get_image_features", None)
    return fn if fn is not None else getattr(getattr(model, "model", None),
                                             "get_image_features", None)


def _required(fn) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _family(model: nn.Module) -> str:
    return f"{type(model).__name__} (model_type {model.config.model_type!r})"


def image_spec(model: nn.Module) -> ImageSpec:
    """How ``model`` (built on the meta device is enough) takes one image; a ``ValueError``
    naming what is missing for a family whose image inputs cannot be derived."""
    config, family = model.config, _family(model)
    forward = set(inspect.signature(model.forward).parameters)
    if getattr(config, "is_encoder_decoder", False) or "decoder_input_ids" in forward:
        raise ValueError(f"{family} is an encoder-decoder model: automodel trains decoder-only "
                         "image-text models (the loss of the inputs' next tokens)")
    features = image_features_fn(model)
    if features is None:
        raise ValueError(f"{family} has no get_image_features: the image inputs it takes "
                         "and the image tokens one image fills cannot be derived from it")
    takes = set(inspect.signature(features).parameters)
    missing = [name for name in _required(features) if name not in KNOWN]
    if missing or "pixel_values" not in takes:
        needs = ", ".join(missing) or "no pixel_values"
        raise ValueError(f"{family}: its get_image_features needs {needs}, which automodel "
                         "cannot derive from the config (it builds "
                         f"{', '.join(sorted(KNOWN))})")
    vc = config.vision_config
    channels = getattr(vc, "in_channels", None) or getattr(vc, "num_channels", None) or 3
    if "image_grid_thw" in takes:
        patch = getattr(vc, "patch_size", None)
        if not isinstance(patch, int):
            raise ValueError(f"{family}: vision_config.patch_size={patch!r}: patch sequences "
                             "need one int patch size")
        merge = getattr(vc, "spatial_merge_size", None) or getattr(config, "spatial_merge_size",
                                                                   None) or 1
        temporal = getattr(vc, "temporal_patch_size", None) or 1
        return ImageSpec(channels, patch_dim=channels * temporal * patch * patch, merge=merge)
    size = getattr(vc, "image_size", None)
    if size is None:
        raise ValueError(f"{family}: vision_config has no image_size, the size of the images "
                         "its tower takes")
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    crops = _crops(model, height, width)
    return ImageSpec(channels, height, width, crops=crops,
                     sizes="image_sizes" in takes,
                     patch_mask="pixel_attention_mask" in takes)


def _crops(model: nn.Module, height: int, width: int) -> int:
    """Crops per image of a family that cuts images into a grid of tiles (its config's
    ``image_grid_pinpoints``), from its modeling module's own count; 0 for one array."""
    pinpoints = getattr(model.config, "image_grid_pinpoints", None)
    count = getattr(sys.modules[type(model).__module__], "image_size_to_num_patches", None)
    if not pinpoints or count is None:
        return 0
    return int(count((height, width), pinpoints, model.config.vision_config.image_size))


def synthetic_image(spec: ImageSpec, seed: int | None) -> dict[str, torch.Tensor]:
    """One image as the model's inputs take it, of random pixels from ``seed`` (``None``: a
    blank image, all ones: some families drop all-zero images as padding). Images of a batch
    are these inputs concatenated along dimension 0."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def pixels(*shape):
        return torch.randn(*shape, generator=gen) if gen is not None else torch.ones(*shape)

    if spec.patch_dim:
        side = 2 * spec.merge  # a grid of 2x2 merged patches: 4 image tokens
        return {"pixel_values": pixels(side * side, spec.patch_dim),
                "image_grid_thw": torch.tensor([[1, side, side]])}
    shape = (spec.channels, spec.height, spec.width)
    if spec.crops:
        image = {"pixel_values": pixels(1, spec.crops, *shape)}
    elif spec.patch_mask:
        image = {"pixel_values": pixels(1, 1, *shape),
                 "pixel_attention_mask": torch.ones(1, 1, spec.height, spec.width,
                                                    dtype=torch.bool)}
    else:
        image = {"pixel_values": pixels(1, *shape)}
    if spec.sizes:
        image["image_sizes"] = torch.tensor([[spec.height, spec.width]])
    return image


def _features_copy(model: nn.Module, device: str) -> nn.Module:
    """A copy of the meta-device ``model`` to run ``get_image_features`` on: every tensor on
    the meta device, or (``cpu``) the parameters outside the language model allocated empty on
    the host (never initialized: only shapes are read), the language model left on meta."""
    from automodel.models.parts import group_of

    copy = deepcopy(model)
    if device == "meta":
        return copy.to("meta")
    for name, module in copy.named_modules():
        for key, param in direct_parameters(module):
            if param is not None and group_of(f"{name}.{key}") != "language":
                set_parameter(module, key, nn.Parameter(torch.empty_like(param, device="cpu"),
                                                        requires_grad=False))
    return copy


@torch.no_grad()
def tokens_per_image(meta_model: nn.Module, image: dict[str, torch.Tensor]) -> int:
    """How many image-token positions one image (its model inputs) fills: the length of the
    features the model's own ``get_image_features`` gives for it. Run on the meta device (no
    weights, no memory); where the features depend on values (images found by their pixels,
    sizes read on the host), with the vision side allocated empty on the host. A
    ``ValueError`` where neither runs."""
    takes = set(inspect.signature(image_features_fn(meta_model)).parameters)
    errors = []
    for device in ("meta", "cpu"):
        copy = _features_copy(meta_model, device)
        args = {k: v.to(device) if k == "pixel_values" else v for k, v in image.items()
                if k in takes}
        try:
            out = image_features_fn(copy)(**args)
            break
        except Exception as err:  # the family's own code, on inputs it does not take
            errors.append(f"{device}: {str(err).splitlines()[0]}")
    else:
        raise ValueError(f"{_family(meta_model)}: its get_image_features does not run on one "
                         f"image of the inputs derived for it ({'; '.join(errors)}), so the "
                         "number of image tokens per image cannot be derived before launch")
    features = getattr(out, "pooler_output", out)
    first = features[0] if isinstance(features, (list, tuple)) else features.flatten(0, -2)
    return int(first.shape[0])
