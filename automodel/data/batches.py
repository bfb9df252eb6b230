"""Which sequences each rank trains on at each step, independent of the parallel layout.

Step ``s`` uses global batch ``s`` of a seeded permutation (a new one each epoch). The global
batch is split into contiguous slices per data-parallel rank, and each slice into
micro-batches. Any layout sees the same global batch at the same step, so losses match.

The rows are token sequences (a tensor ``[n, seq_len + 1]``, or ``data/token_rows.TokenRows``
read from a token stream when a batch asks for them), or image-text samples
(``data/image_text.ImageTextData``); rows packed with document boundaries and image-text
samples give micro-batches with extra model inputs (positions, images).
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100  # a label position with nothing to learn (cross-entropy skips it)


FULL_SHUFFLE_ROWS = 1 << 24  # beyond this, a shuffle whose memory does not grow with the rows


class FeistelShuffle:
    """A seeded permutation of ``n`` rows computed per position, in constant memory: a
    four-round Feistel network over the smallest even power of two >= ``n``, walked again
    until it lands below ``n`` (a bijection of ``0..n-1``)."""

    MULTIPLIERS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)

    def __init__(self, n: int, seed: int):
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        keys = np.random.default_rng(seed).integers(0, 2**63, size=4, dtype=np.int64)
        self.keys = keys.astype(np.uint64)

    def _mix(self, x: np.ndarray, key: np.uint64) -> np.ndarray:
        a, b, c = (np.uint64(m) for m in self.MULTIPLIERS)
        x = (x ^ key) * a
        x ^= x >> np.uint64(31)
        x *= b
        x ^= x >> np.uint64(27)
        x *= c
        return x ^ (x >> np.uint64(31))

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (self._mix(right, key) & self.mask)
        return (left << h) | right

    def __getitem__(self, index: slice) -> torch.Tensor:
        x = np.arange(*index.indices(self.n), dtype=np.uint64)
        with np.errstate(over="ignore"):
            x = self._round_trip(x)
            while (outside := x >= self.n).any():
                x[outside] = self._round_trip(x[outside])
        return torch.from_numpy(x.astype(np.int64))


class BatchPlan:
    """``shuffle=False`` (held-out rows): global batch ``s`` is rows ``s*G .. (s+1)*G - 1``."""

    def __init__(self, sequences, global_batch_size: int, seed: int, shuffle: bool = True,
                 what: str = "the data"):
        if len(sequences) < global_batch_size:
            raise ValueError(f"{what} has {len(sequences)} sequences, fewer than "
                             f"trainer.global_batch_size={global_batch_size}")
        self.sequences = sequences
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.batches_per_epoch = len(sequences) // global_batch_size
        self._epoch = -1
        self._order = None

    def epochs(self, steps: int) -> float:
        """Passes over the rows after ``steps`` global batches."""
        return steps / self.batches_per_epoch

    def _permutation(self, epoch: int):
        """The epoch's order of the rows (indexable by a slice of positions)."""
        if epoch != self._epoch:
            n = len(self.sequences)
            if not self.shuffle:
                self._order = torch.arange(n)
            elif n <= FULL_SHUFFLE_ROWS:  # 4 bytes a row, on every rank
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(n, generator=gen, dtype=torch.int32)
            else:
                self._order = FeistelShuffle(n, self.seed + epoch)
            self._epoch = epoch
        return self._order

    def global_batch(self, step: int) -> torch.Tensor:
        """Rows of global batch ``step`` (0-based)."""
        epoch, index = divmod(step, self.batches_per_epoch)
        order = self._permutation(epoch)
        rows = order[index * self.global_batch_size:(index + 1) * self.global_batch_size]
        return self.sequences[rows]

    def rank_rows(self, step: int, dp_rank: int, dp_size: int):
        """The rows data-parallel rank ``dp_rank`` trains on at ``step``."""
        per_rank = self.global_batch_size // dp_size
        return self.global_batch(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]

    def micro_batches(self, step: int, dp_rank: int, dp_size: int, local_batch_size: int,
                      placeholder_row: bool = True):
        """[(input_ids, labels), ...] for this data-parallel rank at ``step``; rows with extra
        model inputs give (input_ids, labels, extras) (``placeholder_row``: see
        ``ImageTextData.split``)."""
        mine = self.rank_rows(step, dp_rank, dp_size)
        if not isinstance(mine, torch.Tensor):
            options = {} if placeholder_row else {"placeholder_row": False}
            return [mine[i:i + local_batch_size].split(**options)
                    for i in range(0, len(mine), local_batch_size)]
        return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
                for mb in mine.split(local_batch_size)]
