"""Validation of the data options (``data=...``), alone and against the rest of the layout:
each shipped source's own checks (``check_<source>``, which ``data/registry.py`` registers
with it), evaluation's held-out rows, packing, and the model numbers the data depends on.
Pure Python, as ``validate.py``; ``resolve.py`` calls ``check_data`` and
``check_data_with_layout``.
"""

from __future__ import annotations

import os

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.config.validate import _positive


def check_data_with_layout(data, trainer: s.TrainerConfig, mesh: s.MeshConfig, pipeline,
                           par) -> None:
    """Data options that depend on the rest of the layout: evaluation's held-out rows, and
    packing with document boundaries."""
    held_out = data.eval_fraction > 0 or getattr(data, "eval_split", None) is not None
    if trainer.eval_every and not held_out:
        raise ConfigError(f"trainer.eval_every={trainer.eval_every} but no data is held out "
                          "for evaluation: set data.eval_fraction (e.g. 0.05)"
                          + (" or data.eval_split" if hasattr(data, "eval_split") else ""))
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


def check_data(source, data, model: s.ModelConfig):
    """The data options of ``source`` (a ``data/registry.DataSource``): its own checks, then
    what every source shares. Returns the (resolved) config; never changes its input."""
    if source.check is not None:
        data = source.check(data, model)
    fraction = data.eval_fraction
    if not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
        raise ConfigError(f"data.eval_fraction={fraction!r}: the share of the rows held out "
                          "for evaluation, 0 <= value < 1 (0: none)")
    return data


def _byte_level_vocab(data, model: s.ModelConfig, byte_level: bool) -> None:
    vocab = model.config.get("vocab_size")
    if byte_level and vocab is not None and vocab < 256 and model.pretrained_path is None:
        raise ConfigError(f"model.config.vocab_size={vocab}: byte-level data needs >= 256")


def _tokenizer_dir(data) -> None:
    if data.tokenizer_path is not None and not os.path.isdir(data.tokenizer_path):
        raise ConfigError(f"data.tokenizer_path={data.tokenizer_path!r}: no such directory")


def _path_exists(data, source: str, needs: str) -> None:
    if data.path is None:
        raise ConfigError(f"data.path is not set: data={source} needs {needs}")
    if not any(c in data.path for c in "*?[") and not os.path.exists(data.path):
        raise ConfigError(f"data.path={data.path!r}: no such file or directory")


def check_corpus(data: s.CorpusDataConfig, model: s.ModelConfig) -> s.CorpusDataConfig:
    _positive("data.image_every", data.image_every, 0)
    _byte_level_vocab(data, model, True)
    return data


def check_synthetic(data: s.SyntheticDataConfig, model: s.ModelConfig) -> s.SyntheticDataConfig:
    _positive("data.image_every", data.image_every, 0)
    _positive("data.vocab_size", data.vocab_size, 2)
    vocab = model.config.get("vocab_size")
    if vocab is not None and data.vocab_size is not None and data.vocab_size > vocab:
        raise ConfigError(f"data.vocab_size={data.vocab_size} exceeds the model's "
                          f"model.config.vocab_size={vocab}")
    return data


def check_files(data: s.FilesDataConfig, model: s.ModelConfig) -> s.FilesDataConfig:
    if not data.paths:
        raise ConfigError("data.paths is empty: give one or more local .txt/.jsonl files")
    for p in data.paths:
        if not os.path.isfile(p):
            raise ConfigError(f"data.paths contains {p!r}: no such file")
    _tokenizer_dir(data)
    _byte_level_vocab(data, model, data.tokenizer_path is None)
    return data


def check_hf(data: s.HFDataConfig, model: s.ModelConfig) -> s.HFDataConfig:
    _path_exists(data, "hf", "a save_to_disk folder or data files (parquet, jsonl, arrow, "
                 "csv)")
    _tokenizer_dir(data)
    _byte_level_vocab(data, model, data.tokenizer_path is None)
    return data


def check_tokens(data: s.TokensDataConfig, model: s.ModelConfig) -> s.TokensDataConfig:
    _path_exists(data, "tokens", "a .npy array of token ids")
    if data.doc_starts_path is not None and not os.path.isfile(data.doc_starts_path):
        raise ConfigError(f"data.doc_starts_path={data.doc_starts_path!r}: no such file")
    return data
