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

import torch

IGNORE_INDEX = -100  # a label position with nothing to learn (cross-entropy skips it)


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

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(len(self.sequences), generator=gen)
            else:
                self._order = torch.arange(len(self.sequences))
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

    def micro_batches(self, step: int, dp_rank: int, dp_size: int, local_batch_size: int):
        """[(input_ids, labels), ...] for this data-parallel rank at ``step``; rows with extra
        model inputs give (input_ids, labels, extras)."""
        mine = self.rank_rows(step, dp_rank, dp_size)
        if not isinstance(mine, torch.Tensor):
            return [mine[i:i + local_batch_size].split()
                    for i in range(0, len(mine), local_batch_size)]
        return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
                for mb in mine.split(local_batch_size)]
