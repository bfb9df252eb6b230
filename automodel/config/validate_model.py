"""Validation of the model section (torch-free: numbers and paths only)."""

from __future__ import annotations

import os

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.config.value_checks import check_dtype


def model_numbers(model: s.ModelConfig) -> dict:
    """The model's size numbers from model.config, or from config.json of pretrained_path."""
    numbers = dict(model.config)
    if model.pretrained_path is not None:
        path = os.path.join(model.pretrained_path, "config.json")
        if os.path.isfile(path):
            import json

            with open(path, encoding="utf-8") as f:
                numbers = {**json.load(f), **numbers}
    return numbers


def check_model(model: s.ModelConfig) -> None:
    """The model section: its dtype, its pretrained directory and its own numbers."""
    check_dtype("model.dtype", model.dtype, allow_none=False)
    if model.pretrained_path is not None and not os.path.isdir(model.pretrained_path):
        raise ConfigError(f"model.pretrained_path={model.pretrained_path!r}: no such directory")
    hidden, heads = model.config.get("hidden_size"), model.config.get("num_attention_heads")
    kv_heads = model.config.get("num_key_value_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and (heads < 1 or hidden % heads):
        raise ConfigError(f"model.config.num_attention_heads={heads} must divide "
                          f"model.config.hidden_size={hidden}")
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise ConfigError(f"model.config.num_key_value_heads={kv_heads} must divide "
                          f"model.config.num_attention_heads={heads}")
    if model.pretrained_path is None and "model_type" not in model.config:
        raise ConfigError("model.config needs a model_type (e.g. llama, qwen2) when "
                          "model.pretrained_path is null (model=pretrained needs "
                          "model.pretrained_path=/local/dir)")
