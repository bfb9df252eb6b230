"""Validation of the data options (``data=...``), alone and against the rest of the layout:
each shipped source's own checks (``check_<source>``, which ``data/registry.py`` registers
with it), evaluation's held-out rows, packing, and the model numbers the data depends on.
Pure Python, as ``validate.py``; ``resolve.py`` calls ``check_data`` and
``check_data_with_layout``.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.config.validate_model import model_numbers
from automodel.config.value_checks import positive

log = logging.getLogger(__name__)

# The files that make a directory a tokenizer's (``AutoTokenizer.from_pretrained`` reads them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# A vocabulary this small is taken for byte-level (256 byte ids and a few special tokens).
BYTE_LEVEL_MAX_VOCAB = 512


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
    """Byte-level tokens (ids 0-255) need a vocabulary of at least 256 entries; with a
    pretrained model, a byte-level one (the checkpoint's own tokens are not bytes otherwise)."""
    if not byte_level:
        return
    numbers = model_numbers(model)
    vocab = numbers.get("vocab_size") or (numbers.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int):
        return
    if vocab < 256:
        raise ConfigError(f"model.config.vocab_size={vocab}: byte-level data needs >= 256")
    if model.pretrained_path is not None and vocab > BYTE_LEVEL_MAX_VOCAB:
        raise ConfigError(
            f"data.tokenizer_path is not set and model.pretrained_path={model.pretrained_path!r}"
            f" holds no tokenizer ({', '.join(TOKENIZER_FILES)}): the text would be read as "
            f"bytes (ids 0-255), which this model's {vocab}-entry vocabulary does not use; "
            "set data.tokenizer_path=/dir/of/the/model's/tokenizer")


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _tokenizer_dir(data, model: s.ModelConfig):
    """``data.tokenizer_path`` checked; unset, it defaults to ``model.pretrained_path`` when
    that directory holds a tokenizer (the checkpoint's own). Returns the resolved copy."""
    if data.tokenizer_path is not None:
        if not os.path.isdir(data.tokenizer_path):
            raise ConfigError(f"data.tokenizer_path={data.tokenizer_path!r}: no such directory")
        return data
    if model.pretrained_path is None or not _has_tokenizer(model.pretrained_path):
        return data
    log.info("data.tokenizer_path=null: using the tokenizer of model.pretrained_path=%s",
             model.pretrained_path)
    return dataclasses.replace(data, tokenizer_path=model.pretrained_path)


def _path_exists(data, source: str, needs: str) -> None:
    if data.path is None:
        raise ConfigError(f"data.path is not set: data={source} needs {needs}")
    if not any(c in data.path for c in "*?[") and not os.path.exists(data.path):
        raise ConfigError(f"data.path={data.path!r}: no such file or directory")


def check_corpus(data: s.CorpusDataConfig, model: s.ModelConfig) -> s.CorpusDataConfig:
    positive("data.image_every", data.image_every, 0)
    _byte_level_vocab(data, model, model.pretrained_path is None)  # (generated test text)
    return data


def check_synthetic(data: s.SyntheticDataConfig, model: s.ModelConfig) -> s.SyntheticDataConfig:
    positive("data.image_every", data.image_every, 0)
    positive("data.vocab_size", data.vocab_size, 2)
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
    data = _tokenizer_dir(data, model)
    _byte_level_vocab(data, model, data.tokenizer_path is None)
    return data


def check_hf(data: s.HFDataConfig, model: s.ModelConfig) -> s.HFDataConfig:
    _path_exists(data, "hf", "a save_to_disk folder or data files (parquet, jsonl, arrow, "
                 "csv)")
    data = _tokenizer_dir(data, model)
    _byte_level_vocab(data, model, data.tokenizer_path is None)
    data = _resolve_format(data)
    _check_sft(data)
    return data


def _resolve_format(data: s.HFDataConfig) -> s.HFDataConfig:
    """``data.format=auto``: the format the first record shows (``data/sft.py``), so the
    rules below see it; records that cannot be read yet keep ``auto``, and preparing the
    data (the preflight's data check) reads them and says what is wrong."""
    from automodel.data.sft import FORMATS, concrete_format

    if data.format not in FORMATS:
        raise ConfigError(f"data.format={data.format!r}: one of {', '.join(FORMATS)}")
    if data.format != "auto":
        return data
    from automodel.data.hf_dataset import check_source, first_record

    try:
        check_source(data.path, data.split)
        record = first_record(data.path, data.split)
    except Exception:  # (datasets and arrow raise several kinds for unreadable data)
        return data
    try:
        return concrete_format(data, data.split, record)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_sft(data: s.HFDataConfig) -> None:
    """``data.format`` and ``data.train_on`` (``data/sft.py`` renders the records)."""
    train_on = ("all", "completion")
    if data.train_on not in train_on:
        raise ConfigError(f"data.train_on={data.train_on!r}: one of {', '.join(train_on)}")
    if data.format == "auto":  # (not readable yet: checked when the data is prepared)
        return
    from automodel.data.sft import check_train_on

    try:
        check_train_on(data)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if data.format == "chat" and data.tokenizer_path is None:
        raise ConfigError("data.format=chat needs a tokenizer with a chat template: set "
                          "data.tokenizer_path (or model.pretrained_path to a checkpoint "
                          "that holds its tokenizer)")


def check_tokens(data: s.TokensDataConfig, model: s.ModelConfig) -> s.TokensDataConfig:
    _path_exists(data, "tokens", "a .npy array of token ids")
    if data.doc_starts_path is not None and not os.path.isfile(data.doc_starts_path):
        raise ConfigError(f"data.doc_starts_path={data.doc_starts_path!r}: no such file")
    return data
