"""Build a Hugging Face causal LM from config or from a local pretrained directory."""

from __future__ import annotations

import torch
from torch import nn

from automodel.config.schema import ModelConfig


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """Same ``seed`` -> same initial weights on every rank and every layout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(seed)
    if cfg.pretrained_path is not None:
        overrides = {k: v for k, v in cfg.config.items() if k != "model_type"}
        model = AutoModelForCausalLM.from_pretrained(cfg.pretrained_path, dtype=dtype, **overrides)
    else:
        config = AutoConfig.for_model(**cfg.config)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # A KV cache in training is wasted memory, and with activation checkpointing it gives
    # wrong losses or crashes: train without it.
    model.config.use_cache = False
    return model
