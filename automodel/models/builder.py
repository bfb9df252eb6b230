"""Build a Hugging Face causal LM or image-text model from config or a local pretrained
directory, with the parameters ``model.freeze`` names frozen."""

from __future__ import annotations

import os

import torch
from torch import nn

from automodel.compat import parameters_on_meta
from automodel.config.build import ConfigError
from automodel.config.schema import ModelConfig
from automodel.models.multimodal import auto_class, freeze, text_config


def hf_config(cfg: ModelConfig):
    """The transformers config: ``model.config`` (for ``AutoConfig.for_model``), or the
    checkpoint's own config.json with the keys of ``model.config`` over it."""
    from transformers import AutoConfig

    if cfg.pretrained_path is not None:
        overrides = {k: v for k, v in cfg.config.items() if k != "model_type"}
        return AutoConfig.from_pretrained(cfg.pretrained_path, **overrides)
    return AutoConfig.for_model(**cfg.config)


def build_meta_model(cfg: ModelConfig) -> nn.Module:
    """The model's structure without weights: parameters on the meta device, buffers (rotary
    frequencies and the like, computed from the config) on the host. For checks before launch,
    and every rank's starting point (``automodel.distributed.materialize``)."""
    config = hf_config(cfg)
    with parameters_on_meta():
        model = auto_class(config).from_config(config, dtype=getattr(torch, cfg.dtype))
    return _finish(model, cfg)


def check_weights(cfg: ModelConfig) -> None:
    """Training from ``model.pretrained_path`` reads its weights: a directory with a
    config.json only (enough for the meta model, the preflight and plan.py) cannot train."""
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    path = cfg.pretrained_path
    if path is None or any(os.path.isfile(os.path.join(path, n)) for n in names):
        return
    raise ConfigError(f"model.pretrained_path={path!r} holds no weights (none of "
                      f"{', '.join(names)}): its config.json is enough to plan or check a "
                      "layout, but training starts from the checkpoint's weights. Point it at "
                      "the whole checkpoint, or train this architecture from scratch by giving "
                      "its config.json's keys under model.config with no pretrained_path (as "
                      "the presets model=llama3_1_8b, qwen3_8b, ... do)")


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """Same ``seed`` -> same initial weights on every rank and every layout."""
    check_weights(cfg)
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(seed)
    config = hf_config(cfg)
    if cfg.pretrained_path is not None:
        overrides = {k: v for k, v in cfg.config.items() if k != "model_type"}
        model = auto_class(config).from_pretrained(cfg.pretrained_path, dtype=dtype,
                                                   **overrides)
        _keep_frozen_as_built(model, config)
    else:
        model = auto_class(config).from_config(config, dtype=dtype)
    return _finish(model, cfg)


def _keep_frozen_as_built(model: nn.Module, config) -> None:
    """Parameters the model's constructor freezes (Pegasus' sinusoidal positions) stay frozen
    after ``from_pretrained``, which loads every weight as a trainable one: as the meta-device
    build every distributed layout starts from has them."""
    with parameters_on_meta():
        built = type(model)(config)
    frozen = {n for n, p in built.named_parameters() if not p.requires_grad}
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def _finish(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    # A KV cache in training is wasted memory, and with activation checkpointing it gives
    # wrong losses or crashes: train without it.
    model.config.use_cache = False
    text_config(model.config).use_cache = False
    if cfg.freeze:
        freeze(model, list(cfg.freeze))
    return model
