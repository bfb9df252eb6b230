"""Turn a data config into training rows: one long token stream cut into sequences, or, for
an image-text model, image-text samples (``data/image_text.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from automodel.config.schema import CorpusDataConfig, FilesDataConfig, SyntheticDataConfig
from automodel.data.corpus import generate_documents
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
    """The corpus of a text source as one token stream with its document starts."""
    if source == "hf":
        from automodel.data.token_cache import hf_stream

        return hf_stream(data, data.split)
    if source == "tokens":
        from automodel.data.token_cache import token_file_stream

        return token_file_stream(data)
    if source == "corpus":
        assert isinstance(data, CorpusDataConfig)
        docs = generate_documents(data.num_documents, data.seed)
        encode = Encoder(None)
    else:
        assert isinstance(data, FilesDataConfig)
        docs = read_documents(data.paths, data.text_key)
        encode = Encoder(data.tokenizer_path)
    return TokenStream.from_flat(*encode(docs))


def check_vocabulary(stream: TokenStream, model_vocab: int) -> None:
    if stream.max_token >= model_vocab:
        raise ValueError(f"the data has token id {stream.max_token} but the model's vocabulary "
                         f"has {model_vocab} entries (model.config.vocab_size): use the model's "
                         "own tokenizer (data.tokenizer_path), or a larger vocabulary")


def token_rows(source: str, data, seq_len: int, model_vocab: int):
    """The training rows of a text source: a ``[n, seq_len + 1]`` tensor (synthetic data),
    or ``TokenRows`` over its token stream (inputs and next-token labels come from each
    row)."""
    if source == "synthetic":
        assert isinstance(data, SyntheticDataConfig)
        vocab = data.vocab_size or model_vocab
        gen = torch.Generator().manual_seed(data.seed)
        return torch.randint(0, vocab, (data.num_sequences, seq_len + 1), generator=gen)
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
    ``ModelConfig``): token rows, or for an image-text model samples with images: generated
    ones on the text of ``corpus``/``synthetic`` (``data.image_every``), or those of ``files``
    through the model's processor (``data/image_files.py``). The held-out rows are
    ``data.eval_split`` (``hf``), else the last ``data.eval_fraction`` of the rows."""
    from automodel.data import image_text
    from automodel.models import multimodal as mm
    from automodel.models.builder import build_meta_model

    meta = build_meta_model(model_cfg)  # structure only: no weights are allocated
    vocab = mm.text_config(meta.config).vocab_size
    if not mm.is_image_text(meta.config):
        rows = token_rows(source, data, seq_len, vocab)
    elif source == "files":
        from automodel.data.image_files import read_image_text

        processor_dir = data.tokenizer_path or model_cfg.pretrained_path
        if processor_dir is None:
            raise ValueError(f"data=files with the image-text model {type(meta).__name__} "
                             "needs the model's processor: set data.tokenizer_path to its "
                             "directory (or train model=pretrained, whose directory holds it)")
        rows = read_image_text(data, seq_len, meta, processor_dir)
    elif source in ("corpus", "synthetic"):
        fmt, count = image_text.synthetic_format(meta.config, meta, data.seed)
        rows = image_text.add_images(token_sequences(source, data, seq_len, vocab), fmt, count,
                                     data.image_every)
    else:
        raise ValueError(f"data={source} with the image-text model {type(meta).__name__}: "
                         "image-text models train on data=files (JSONL samples with image "
                         "paths), corpus or synthetic")
    if getattr(data, "eval_split", None) is not None:
        from automodel.data.token_cache import hf_stream

        held = TokenRows(hf_stream(data, data.eval_split), seq_len, data.pack_boundaries)
        check_vocabulary(held.stream, vocab)
        return rows, held
    if data.eval_fraction <= 0:
        return rows, None
    held = int(round(len(rows) * data.eval_fraction))
    if held < 1 or held >= len(rows):
        raise ValueError(f"data.eval_fraction={data.eval_fraction} of {len(rows)} rows holds "
                         f"out {held}: choose a fraction that leaves rows on both sides")
    return rows[:len(rows) - held], rows[len(rows) - held:]
