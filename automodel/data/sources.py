"""Turn a data config into training rows: one long token stream cut into sequences, or, for
an image-text model, image-text samples (``data/image_text.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from automodel.config.schema import CorpusDataConfig, FilesDataConfig, SyntheticDataConfig
from automodel.data.corpus import generate_documents

BYTE_VOCAB = 256
BYTE_SEPARATOR = ord("\n")  # documents are separated by a newline byte


def _bytes_stream(docs: list[str]) -> torch.Tensor:
    data = ("\n".join(docs) + "\n").encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def _tokenizer_stream(docs: list[str], tokenizer_path: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    sep = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    ids: list[int] = []
    for doc in docs:
        ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
        if sep is not None:
            ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


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


def token_sequences(source: str, data, seq_len: int, model_vocab: int) -> torch.Tensor:
    """Rows of ``seq_len + 1`` tokens (inputs and next-token labels come from each row)."""
    if source == "synthetic":
        assert isinstance(data, SyntheticDataConfig)
        vocab = data.vocab_size or model_vocab
        gen = torch.Generator().manual_seed(data.seed)
        return torch.randint(0, vocab, (data.num_sequences, seq_len + 1), generator=gen)
    if source == "corpus":
        assert isinstance(data, CorpusDataConfig)
        stream = _bytes_stream(generate_documents(data.num_documents, data.seed))
    else:
        assert isinstance(data, FilesDataConfig)
        docs = read_documents(data.paths, data.text_key)
        stream = (_tokenizer_stream(docs, data.tokenizer_path) if data.tokenizer_path
                  else _bytes_stream(docs))
    if int(stream.max()) >= model_vocab:
        raise ValueError(f"the data has token id {int(stream.max())} but the model's vocabulary "
                         f"has {model_vocab} entries (model.config.vocab_size)")
    rows = stream.numel() // (seq_len + 1)
    if rows == 0:
        raise ValueError(f"the data has {stream.numel()} tokens, fewer than one sequence of "
                         f"trainer.seq_len+1={seq_len + 1}")
    return stream[: rows * (seq_len + 1)].view(rows, seq_len + 1)


def training_rows(source: str, data, seq_len: int, model_cfg):
    """What ``BatchPlan`` draws from for the model ``model_cfg`` (a ``ModelConfig``): token
    rows, or for an image-text model samples with images: generated ones on the text of
    ``corpus``/``synthetic`` (``data.image_every``), or those of ``files`` through the model's
    processor (``data/image_files.py``)."""
    from automodel.data import image_text
    from automodel.models import multimodal as mm
    from automodel.models.builder import build_meta_model

    meta = build_meta_model(model_cfg)  # structure only: no weights are allocated
    if not mm.is_image_text(meta.config):
        return token_sequences(source, data, seq_len, mm.text_config(meta.config).vocab_size)
    if source == "files":
        from automodel.data.image_files import read_image_text

        processor_dir = data.tokenizer_path or model_cfg.pretrained_path
        if processor_dir is None:
            raise ValueError(f"data=files with the image-text model {type(meta).__name__} "
                             "needs the model's processor: set data.tokenizer_path to its "
                             "directory (or train model=pretrained, whose directory holds it)")
        return read_image_text(data, seq_len, meta, processor_dir)
    rows = token_sequences(source, data, seq_len, mm.text_config(meta.config).vocab_size)
    fmt, count = image_text.synthetic_format(meta.config, meta, data.seed)
    return image_text.add_images(rows, fmt, count, data.image_every)
