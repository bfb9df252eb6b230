"""The router's load-balancing loss of a mixture-of-experts model, the same in every layout.

transformers' MoE families add ``router_aux_loss_coef * aux`` to their loss when their config
sets ``output_router_logits``. ``aux`` (``load_balancing_loss_func``) is computed from the
router logits of all layers of one forward: with ``f[k, e]`` the fraction of rows whose k-th
choice is expert ``e`` and ``p[e]`` the mean router probability of ``e``,
``aux = num_experts * sum(f * p)``.

One forward's rows depend on the layout (how the batch is split over ranks and micro-batches,
and under context parallelism a sequence is split too), so here the model's formula is
applied to each sequence (its tokens in all layers) and averaged over the sequences of the
global batch. Only ``p`` carries a gradient, and ``sum(f * p)`` is linear in ``p``: a context-
parallel rank sums ``f`` over the ranks holding the sequence (no gradient) and contributes
its own tokens' part of ``p``. The result is identical whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from automodel.models.experts import is_moe


@dataclass(frozen=True)
class RouterLoss:
    num_experts: int
    top_k: int
    coef: float

    @classmethod
    def of(cls, model: nn.Module) -> RouterLoss | None:
        """The model's router loss when its config asks for it, else None."""
        cfg = model.config
        if not getattr(cfg, "output_router_logits", False) or not is_moe(model):
            return None
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        return cls(experts, cfg.num_experts_per_tok, float(cfg.router_aux_loss_coef))

    def per_sequence(self, router_logits: tuple, batch: int, group=None) -> torch.Tensor:
        """[batch] load-balancing terms of this rank's tokens: summed over the ranks of
        ``group`` (context parallelism), each is the sequence's ``aux``."""
        logits = torch.stack([t.float() for t in router_logits])  # [L, B*S, E]
        layers = logits.shape[0]
        probs = F.softmax(logits, dim=-1).reshape(layers, batch, -1, self.num_experts)
        _, chosen = torch.topk(probs, self.top_k, dim=-1)  # [L, B, S, k]
        counts = F.one_hot(chosen, self.num_experts).sum(dim=(0, 2)).float()  # [B, k, E]
        rows = torch.full((batch, self.top_k, 1), float(layers * probs.shape[2]),
                          device=probs.device)
        if group is not None:  # the sequence's counts and rows over all its ranks
            both = torch.cat([counts, rows], dim=-1)
            dist.all_reduce(both, group=group)
            counts, rows = both[..., :-1], both[..., -1:]
        fraction = counts / rows  # [B, k, E]
        prob_sum = probs.sum(dim=(0, 2))  # [B, E]: this rank's part, with its gradient
        return self.num_experts * (fraction * prob_sum[:, None, :]).sum(dim=(1, 2)) \
            / rows[:, 0, 0]
