"""Tied input/output embeddings under pipeline parallelism.

The first stage holds the embedding and the last stage the LM head; with tied weights both
hold a copy of the one shared weight (under the same name). The copies start equal (same
initialization or checkpoint) and stay equal: after backward their gradients are summed, the
first stage's (through the embedding) and the last stage's (through the head), so both
optimizers apply the same update. The sum runs over a two-rank group per pipeline (one group
for each data/tensor-parallel coordinate), as Megatron does, or locally when one rank holds
both stages (V placement). The gradient norm counts the shared weight once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from automodel.compat import local_tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t) if isinstance(t, DTensor) else t


class TiedEmbeddingSync:
    def __init__(self, parts: list[nn.Module], stage_ids: list[int], holders: list,
                 mesh, timeout):
        """``holders``: each pp rank's stage indices (``schedule.stages_by_rank``)."""
        num_stages = 1 + max(s for ids in holders for s in ids)
        last = num_stages - 1
        # this rank's copies of the shared weight, by stage
        self.copies = {sid: (part.get_input_embeddings() if sid == 0
                             else part.get_output_embeddings()).weight
                       for part, sid in zip(parts, stage_ids) if sid in (0, last)}
        first_pp = next(r for r, ids in enumerate(holders) if 0 in ids)
        last_pp = next(r for r, ids in enumerate(holders) if last in ids)
        self.group = None
        if first_pp != last_pp:
            ranks = mesh.device_mesh.mesh  # global ranks; the pipeline axis comes first
            firsts, lasts = ranks[first_pp].flatten().tolist(), ranks[last_pp].flatten().tolist()
            me = dist.get_rank()
            pair = next((p for p in zip(firsts, lasts) if me in p), None)
            if pair is not None:  # only the pair's two ranks create it: ranks outside the
                # model's mesh (another model of the job) never take part
                self.group = dist.new_group(list(pair), timeout=timeout,
                                            use_local_synchronization=True)
        # the copy left out of the gradient norm (the other one counts it)
        self.not_in_norm = {id(self.copies[last])} if last in self.copies and (
            0 in self.copies or self.group is not None) else set()

    def sync_grads(self) -> None:
        grads = [p.grad for p in self.copies.values() if p.grad is not None]
        if len(self.copies) == 2:  # both stages on this rank
            a, b = (_local(g) for g in grads)
            a.add_(b)
            b.copy_(a)
        elif self.group is not None and self.copies:
            [grad] = grads
            dist.all_reduce(_local(grad), group=self.group)
