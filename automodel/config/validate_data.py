"""Validation of the data options (``data=...``), alone and against the rest of the layout:
the sources' files, evaluation's held-out rows, packing, and the model numbers the data
depends on. Pure Python, as ``validate.py``; ``resolve.py`` calls them.
"""

from __future__ import annotations

import os

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.config.validate import _positive


def check_data_with_layout(source: str, data, trainer: s.TrainerConfig, mesh: s.MeshConfig,
                           pipeline, par) -> None:
    """Data options that depend on the rest of the layout: evaluation's held-out rows, and
    packing with document boundaries."""
    held_out = data.eval_fraction > 0 or getattr(data, "eval_split", None) is not None
    if trainer.eval_every and not held_out:
        raise ConfigError(f"trainer.eval_every={trainer.eval_every} but no data is held out "
                          "for evaluation: set data.eval_fraction (e.g. 0.05)"
                          + (" or data.eval_split" if source == "hf" else ""))
    if not getattr(data, "pack_boundaries", False):
        return
    if mesh.cp_size > 1:
        raise ConfigError(f"data.pack_boundaries=true with mesh.cp_size={mesh.cp_size}: context "
                          "parallel attention runs its own causal chunks and cannot keep "
                          "documents apart; set data.pack_boundaries=false or mesh.cp_size=1")
    if pipeline is not None:
        raise ConfigError("data.pack_boundaries=true with a pipeline: the stages take their "
                          "positions from the sequence length, not per document; set "
                          "data.pack_boundaries=false or pipeline=none")
    if getattr(par, "patch_is_packed_sequence", False):
        raise ConfigError("data.pack_boundaries=true with parallelism.patch_is_packed_sequence="
                          "true: that patch tells transformers no row is packed, which would "
                          "let documents attend to each other; set one of them to false")


def check_data(source: str, data, model: s.ModelConfig) -> None:
    vocab = model.config.get("vocab_size")
    _positive("data.image_every", getattr(data, "image_every", None), 0)
    if source == "files":
        if not data.paths:
            raise ConfigError("data.paths is empty: give one or more local .txt/.jsonl files")
        for p in data.paths:
            if not os.path.isfile(p):
                raise ConfigError(f"data.paths contains {p!r}: no such file")
        if data.tokenizer_path is not None and not os.path.isdir(data.tokenizer_path):
            raise ConfigError(f"data.tokenizer_path={data.tokenizer_path!r}: no such directory")
    if source in ("hf", "tokens"):
        if data.path is None:
            raise ConfigError(f"data.path is not set: data={source} needs "
                              + ("a save_to_disk folder or data files (parquet, jsonl, arrow, "
                                 "csv)" if source == "hf" else "a .npy array of token ids"))
        if not any(c in data.path for c in "*?[") and not os.path.exists(data.path):
            raise ConfigError(f"data.path={data.path!r}: no such file or directory")
    if source == "hf" and data.tokenizer_path is not None and not os.path.isdir(
            data.tokenizer_path):
        raise ConfigError(f"data.tokenizer_path={data.tokenizer_path!r}: no such directory")
    if source == "tokens" and data.doc_starts_path is not None and not os.path.isfile(
            data.doc_starts_path):
        raise ConfigError(f"data.doc_starts_path={data.doc_starts_path!r}: no such file")
    fraction = data.eval_fraction
    if not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
        raise ConfigError(f"data.eval_fraction={fraction!r}: the share of the rows held out "
                          "for evaluation, 0 <= value < 1 (0: none)")
    if source == "synthetic":
        _positive("data.vocab_size", data.vocab_size, 2)

        if vocab is not None and data.vocab_size is not None and data.vocab_size > vocab:
            raise ConfigError(f"data.vocab_size={data.vocab_size} exceeds the model's "
                              f"model.config.vocab_size={vocab}")
    byte_level = source == "corpus" or (source in ("files", "hf")
                                        and data.tokenizer_path is None)
    if byte_level and vocab is not None and vocab < 256 and model.pretrained_path is None:
        raise ConfigError(f"model.config.vocab_size={vocab}: byte-level data needs >= 256")
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
