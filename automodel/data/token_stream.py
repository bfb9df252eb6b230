"""A corpus as one stream of token ids and where its documents start.

Every text source ends up as a ``TokenStream``: the shipped corpus and ``data=files`` in
memory, ``data=hf`` and ``data=tokens`` as memory-mapped arrays on disk
(``data/token_cache.py``), read a row at a time, so a rank's resident memory does not grow
with the corpus.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np


@dataclass
class TokenStream:
    tokens: np.ndarray  # [n] token ids (a memory map for large corpora)
    doc_starts: np.ndarray  # [d] increasing offsets of each document's first token (0 first)
    max_token: int  # the largest id in ``tokens`` (checked against the model's vocabulary)
    # [n] uint8, 1 where a token is a training target (``data.train_on=completion``); None: all
    train: Optional[np.ndarray] = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def from_documents(cls, docs: list[list[int]]) -> "TokenStream":
        """A stream of tokenized documents (each already ending in its separator)."""
        lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
        flat = np.fromiter((t for d in docs for t in d), np.int64, int(lengths.sum()))
        return cls.from_flat(flat, lengths)

    @classmethod
    def from_flat(cls, tokens: np.ndarray, lengths: np.ndarray) -> "TokenStream":
        """A stream of documents given end to end, and their lengths."""
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        return cls(tokens, starts, int(tokens.max()) if len(tokens) else -1)


META = "meta.json"
TOKENS = "tokens.bin"
DOC_STARTS = "doc_starts.npy"
TRAIN = "train.bin"  # one byte a token: 1 = trained on (only with data.train_on=completion)
FORMAT = 1


def token_dtype(max_token: int):
    """The smallest unsigned type holding ids up to ``max_token`` (bytes: 1 byte a token)."""
    return np.uint8 if max_token < 2 ** 8 else np.uint16 if max_token < 2 ** 16 else np.uint32


def write_meta(folder: Path, **fields) -> None:
    (folder / META).write_text(json.dumps({"format": FORMAT, **fields}, indent=1))


def open_stream(folder: str | os.PathLike) -> TokenStream:
    """The stream saved in ``folder`` (``token_cache.py`` writes it), memory-mapped; a folder
    that is not a complete stream is an error naming what is wrong and the fix."""
    folder = Path(folder)
    fix = f"delete {folder} and run again to rebuild it"
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"token cache {folder}: cannot read {META} ({err}); {fix}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"token cache {folder}: format {meta.get('format')}, this version "
                         f"reads {FORMAT}; {fix}")
    dtype = np.dtype(meta["dtype"])
    size = (folder / TOKENS).stat().st_size if (folder / TOKENS).exists() else -1
    if size != meta["num_tokens"] * dtype.itemsize:
        raise ValueError(f"token cache {folder}: {TOKENS} has {size} bytes, {META} says "
                         f"{meta['num_tokens']} tokens of {dtype.itemsize} bytes: corrupt; "
                         f"{fix}")
    try:
        starts = np.load(folder / DOC_STARTS, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise ValueError(f"token cache {folder}: cannot read {DOC_STARTS} ({err}); {fix}") \
            from None
    if starts.shape != (meta["num_docs"],):
        raise ValueError(f"token cache {folder}: {DOC_STARTS} holds {starts.shape} offsets, "
                         f"{META} says {meta['num_docs']} documents: corrupt; {fix}")
    tokens = (np.memmap(folder / TOKENS, dtype=dtype, mode="r", shape=(meta["num_tokens"],))
              if meta["num_tokens"] else np.zeros(0, dtype=dtype))
    return TokenStream(tokens, starts, int(meta["max_token"]), _train_mask(folder, meta, fix))


def _train_mask(folder: Path, meta: dict, fix: str) -> Optional[np.ndarray]:
    if not meta.get("train_mask"):
        return None
    size = (folder / TRAIN).stat().st_size if (folder / TRAIN).exists() else -1
    if size != meta["num_tokens"]:
        raise ValueError(f"token cache {folder}: {TRAIN} has {size} bytes for "
                         f"{meta['num_tokens']} tokens: corrupt; {fix}")
    return np.memmap(folder / TRAIN, dtype=np.uint8, mode="r", shape=(meta["num_tokens"],))
