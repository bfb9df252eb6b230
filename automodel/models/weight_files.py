"""A pretrained model directory's weight files: which file holds each tensor, and the dtype its
weights are stored in (what an export writes by default)."""

from __future__ import annotations

import functools
import json
import os
import struct

from automodel.config.schema import ModelConfig


def safetensors_files(path: str) -> dict[str, str] | None:
    """Tensor name -> file of a safetensors checkpoint directory (single file or index), or
    None when it has no safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        return None
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def model_source(cfg: ModelConfig) -> dict:
    """Where the model came from, as a checkpoint records it for its export: the pretrained
    directory (or None: built from config) and the dtype its weights were stored in there
    (the first floating tensor's in its safetensors header, else its config's ``dtype``), or
    ``model.dtype`` for a model built from config."""
    return {"path": cfg.pretrained_path, "dtype": _stored_dtype(cfg.pretrained_path, cfg.dtype)}


@functools.lru_cache(maxsize=8)
def _stored_dtype(path: str | None, default: str) -> str:
    if path is None:
        return default
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    for file in sorted(set((safetensors_files(path) or {}).values()))[:1]:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        found = [names[v["dtype"]] for k, v in header.items()
                 if k != "__metadata__" and v["dtype"] in names]
        if found:
            return found[0]
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            values = json.load(f)
        stored = values.get("dtype") or values.get("torch_dtype")
        if stored in names.values():
            return stored
    return default
