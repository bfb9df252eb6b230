"""Turn a data config into training rows: one long token stream cut into sequences, or, for
an image-text model, image-text samples (``data/image_text.py``).

The functions taking a source's name look it up in ``data/registry.py`` and call its hooks;
the shipped sources' hooks are the functions below them (``corpus_stream``, ...)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from automodel.data.corpus import generate_documents
from automodel.data.registry import data_source, image_text_refusal
from automodel.data.token_cache import Encoder
from automodel.data.token_rows import TokenRows
from automodel.data.token_stream import TokenStream


def read_documents(paths: list[str], text_key: str) -> list[str]:
    docs: list[str] = []
    for path in paths:
        text = Path(path).read_text(encoding="utf-8")
        if path.endswith(".jsonl"):
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if text_key not in record:
                    raise ValueError(f"{path}:{lineno}: no '{text_key}' field (data.text_key)")
                docs.append(str(record[text_key]))
        else:
            docs.extend(block.strip() for block in text.split("\n\n") if block.strip())
    if not docs:
        raise ValueError(f"data.paths={paths}: no documents found")
    return docs


def token_stream(source: str, data) -> TokenStream:
    """The corpus of the text source called ``source`` as one token stream with its document
    starts."""
    src = data_source(source)
    if src.stream is None:
        raise ValueError(f"data={source} has no token stream: its rows are made directly")
    return src.hook("stream")(data)


def check_vocabulary(stream: TokenStream, model_vocab: int) -> None:
    if stream.max_token >= model_vocab:
        raise ValueError(f"the data has token id {stream.max_token} but the model's vocabulary "
                         f"has {model_vocab} entries (model.config.vocab_size): use the model's "
                         "own tokenizer (data.tokenizer_path), or a larger vocabulary")


def token_rows(source: str, data, seq_len: int, model_vocab: int):
    """The training rows of a text source: a ``[n, seq_len + 1]`` tensor (its ``rows`` hook,
    e.g. synthetic data), or ``TokenRows`` over its token stream (inputs and next-token labels
    come from each row)."""
    src = data_source(source)
    if src.rows is not None:
        return src.hook("rows")(data, seq_len, model_vocab)
    stream = token_stream(source, data)
    check_vocabulary(stream, model_vocab)
    rows = TokenRows(stream, seq_len, getattr(data, "pack_boundaries", False))
    if len(rows) == 0:
        raise ValueError(f"the data has {stream.num_tokens} tokens, fewer than one sequence of "
                         f"trainer.seq_len+1={seq_len + 1}")
    return rows


def token_sequences(source: str, data, seq_len: int, model_vocab: int) -> torch.Tensor:
    """All rows of a text source as one tensor ``[n, seq_len + 1]`` (small corpora)."""
    rows = token_rows(source, data, seq_len, model_vocab)
    return rows if isinstance(rows, torch.Tensor) else TokenRows(
        rows.stream, seq_len)[torch.arange(len(rows))]


def training_data(source: str, data, seq_len: int, model_cfg):
    """(training rows, held-out rows or None) for the model ``model_cfg`` (a
    ``ModelConfig``): token rows, or for an image-text model the samples of the source's
    ``image_text`` hook (generated images on the text of ``corpus``/``synthetic``,
    ``data.image_every``; ``files`` through the model's processor, ``data/image_files.py``).
    The held-out rows are the source's own (``data.eval_split`` of ``hf``), else the last
    ``data.eval_fraction`` of the rows."""
    from automodel.models import multimodal as mm
    from automodel.models.builder import build_meta_model

    src = data_source(source)
    meta = build_meta_model(model_cfg)  # structure only: no weights are allocated
    vocab = mm.text_config(meta.config).vocab_size
    if not mm.is_image_text(meta.config):
        rows = token_rows(source, data, seq_len, vocab)
    elif src.image_text is None:
        raise ValueError(image_text_refusal(source, type(meta).__name__))
    else:
        rows = src.hook("image_text")(data, seq_len, model_cfg, meta,
                                      lambda: token_sequences(source, data, seq_len, vocab))
    held = src.hook("held_out")(data, seq_len, vocab) if src.held_out is not None else None
    if held is not None:
        return rows, held
    if data.eval_fraction <= 0:
        return rows, None
    held = int(round(len(rows) * data.eval_fraction))
    if held < 1 or held >= len(rows):
        raise ValueError(f"data.eval_fraction={data.eval_fraction} of {len(rows)} rows holds "
                         f"out {held}: choose a fraction that leaves rows on both sides")
    return rows[:len(rows) - held], rows[len(rows) - held:]


# --------------------------------------------------------------------------- shipped hooks
def corpus_stream(data) -> TokenStream:
    """``data=corpus``: the generated documents, byte-level tokens."""
    return TokenStream.from_flat(*Encoder(None)(generate_documents(data.num_documents,
                                                                   data.seed)))


def files_stream(data) -> TokenStream:
    """``data=files``: the documents of the files, through ``data.tokenizer_path`` (else
    bytes)."""
    docs = read_documents(data.paths, data.text_key)
    return TokenStream.from_flat(*Encoder(data.tokenizer_path)(docs))


def hf_stream(data) -> TokenStream:
    """``data=hf``: the tokens of ``data.split`` (a memory-mapped cache entry)."""
    from automodel.data.token_cache import hf_stream as split_stream

    return split_stream(data, data.split)


def hf_eval_rows(data, seq_len: int, model_vocab: int):
    """``data=hf``: the rows of ``data.eval_split`` when set."""
    if data.eval_split is None:
        return None
    from automodel.data.token_cache import hf_stream as split_stream

    held = TokenRows(split_stream(data, data.eval_split), seq_len, data.pack_boundaries)
    check_vocabulary(held.stream, model_vocab)
    return held


def synthetic_rows(data, seq_len: int, model_vocab: int) -> torch.Tensor:
    """``data=synthetic``: uniform random tokens from ``data.seed``."""
    vocab = data.vocab_size or model_vocab
    gen = torch.Generator().manual_seed(data.seed)
    return torch.randint(0, vocab, (data.num_sequences, seq_len + 1), generator=gen)


def prepare_hf(data, model_vocab: int) -> None:
    """``data=hf`` before launch: build (or find) the cache of the split, and of the evaluation
    split, and check their ids against the model's vocabulary."""
    from automodel.data.token_cache import hf_stream as split_stream

    check_vocabulary(hf_stream(data), model_vocab)
    if data.eval_split is not None:
        check_vocabulary(split_stream(data, data.eval_split), model_vocab)


def prepare_tokens(data, model_vocab: int) -> None:
    """``data=tokens`` before launch: scan the arrays once and check their ids."""
    from automodel.data.token_cache import token_file_stream

    check_vocabulary(token_file_stream(data), model_vocab)


def generated_image_text(data, seq_len: int, model_cfg, meta_model, text_rows):
    """Image-text samples from the source's rows: generated images (from ``data.seed``) every
    ``data.image_every``-th row."""
    from automodel.data import image_text

    fmt, count = image_text.synthetic_format(meta_model.config, meta_model, data.seed)
    return image_text.add_images(text_rows(), fmt, count, data.image_every)


def check_generated_images(meta_model) -> None:
    """Before launch: the family takes generated images (``ValueError`` naming what not)."""
    from automodel.data.image_text import synthetic_format

    synthetic_format(meta_model.config, meta_model, 0)


def files_image_text(data, seq_len: int, model_cfg, meta_model, text_rows):
    """``data=files`` with an image-text model: the JSONL samples through its processor."""
    from automodel.data.image_files import read_image_text

    processor_dir = data.tokenizer_path or model_cfg.pretrained_path
    if processor_dir is None:
        raise ValueError(f"data=files with the image-text model {type(meta_model).__name__} "
                         "needs the model's processor: set data.tokenizer_path to its "
                         "directory (or train model=pretrained, whose directory holds it)")
    return read_image_text(data, seq_len, meta_model, processor_dir)


def check_processor_images(meta_model) -> None:
    """Before launch: the family takes the images its processor makes."""
    from automodel.models.image_inputs import image_spec
    from automodel.models.multimodal import image_token_id

    image_spec(meta_model)
    image_token_id(meta_model.config)
