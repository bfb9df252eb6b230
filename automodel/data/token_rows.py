"""Training rows cut from a token stream: row ``i`` is tokens ``[i*(L+1), (i+1)*(L+1))``
(``L`` = ``trainer.seq_len``), read from the stream only when a batch asks for it.

Rows pack several documents. With ``data.pack_boundaries=true`` each row also carries its
positions, restarting at 0 at the row's start and at every document start, and the label
that would predict a new document's first token from the previous one's last is ignored.
transformers turns restarting positions into attention that stays inside each document
(``find_packed_sequence_indices``), so a packed row trains exactly as its documents would
one by one, without padding.

A stream with a train mask (``data.train_on=completion``) gives rows whose labels are kept
only where the mask says (the assistant turns, the completions): the mask is read with the
tokens, so the labels travel with their rows in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from automodel.data.batches import IGNORE_INDEX
from automodel.data.token_stream import TokenStream


@dataclass
class PackedRows:
    """Rows with document boundaries (``pack_boundaries``) and/or a train mask."""

    tokens: torch.Tensor  # [n, L + 1]
    doc_start: Optional[torch.Tensor]  # [n, L + 1] bool: a document starts at this token
    train: Optional[torch.Tensor] = None  # [n, L + 1] bool: this token is a training target

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index) -> "PackedRows":
        return PackedRows(*(None if t is None else t[index]
                            for t in (self.tokens, self.doc_start, self.train)))

    def split(self):
        """(inputs, labels[, {"position_ids": positions restarting at each document}])."""
        inputs = self.tokens[:, :-1].contiguous()
        labels = self.tokens[:, 1:].clone()
        if self.train is not None:
            labels[~self.train[:, 1:]] = IGNORE_INDEX  # not trained on (e.g. a prompt)
        if self.doc_start is None:
            return inputs, labels
        labels[self.doc_start[:, 1:]] = IGNORE_INDEX  # nothing predicts a document's start
        return inputs, labels, {"position_ids": restart_positions(self.doc_start[:, :-1])}


def restart_positions(doc_start: torch.Tensor) -> torch.Tensor:
    """Positions 0, 1, ... restarting at each True of ``doc_start`` (and at column 0)."""
    n, length = doc_start.shape
    index = torch.arange(length).expand(n, length)
    starts = torch.where(doc_start, index, torch.zeros_like(index))
    return index - starts.cummax(dim=1).values


class TokenRows:
    """Rows ``[first, last)`` of a stream (all of them by default)."""

    def __init__(self, stream: TokenStream, seq_len: int, pack_boundaries: bool = False,
                 first: int = 0, last: int | None = None):
        self.stream = stream
        self.width = seq_len + 1
        self.pack_boundaries = pack_boundaries
        total = stream.num_tokens // self.width
        self.first, self.last = first, total if last is None else last

    def __len__(self) -> int:
        return self.last - self.first

    def __getitem__(self, index):
        """Rows by position: a slice gives a ``TokenRows`` view; an index tensor reads those
        rows (a tensor ``[k, L+1]``, or ``PackedRows`` with boundaries)."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("TokenRows: only contiguous slices")
            return TokenRows(self.stream, self.width - 1, self.pack_boundaries,
                             self.first + start, self.first + stop)
        rows = torch.as_tensor(index).reshape(-1).numpy().astype(np.int64) + self.first
        offsets = rows[:, None] * self.width + np.arange(self.width)
        tokens = torch.from_numpy(np.asarray(self.stream.tokens[offsets.reshape(-1)],
                                             dtype=np.int64).reshape(len(rows), self.width))
        train = self.stream.train
        if not self.pack_boundaries and train is None:
            return tokens
        if train is not None:
            train = torch.from_numpy(np.asarray(train[offsets.reshape(-1)], dtype=bool)
                                     .reshape(len(rows), self.width))
        return PackedRows(tokens, self._doc_starts(rows) if self.pack_boundaries else None,
                          train)

    def _doc_starts(self, rows: np.ndarray) -> torch.Tensor:
        starts = self.stream.doc_starts
        mask = np.zeros((len(rows), self.width), dtype=bool)
        for i, row in enumerate(rows):
            begin = int(row) * self.width
            lo, hi = np.searchsorted(starts, [begin, begin + self.width])
            mask[i, np.asarray(starts[lo:hi]) - begin] = True
        return torch.from_numpy(mask)
