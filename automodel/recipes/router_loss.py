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

Under a pipeline a stage holds only some layers: each stage adds its layers' sums (counts
and probability sums, :meth:`RouterLoss.stage_stats`) to those it receives and sends them on
with its activations; the last stage applies the formula to the sums of all layers
(:meth:`RouterLoss.from_stats`), so the number is the same as without a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from automodel.models.experts import is_moe
from automodel.models.multimodal import text_config


@dataclass(frozen=True)
class RouterLoss:
    num_experts: int
    top_k: int
    coef: float

    @classmethod
    def of(cls, model: nn.Module) -> RouterLoss | None:
        """The model's router loss when its config asks for it, else None."""
        cfg = text_config(model.config)  # (an image-text model's: its language model's)
        if not getattr(cfg, "output_router_logits", False) or not is_moe(model):
            return None
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        return cls(experts, cfg.num_experts_per_tok, float(cfg.router_aux_loss_coef))

    def per_sequence(self, router_logits: tuple, batch: int, group=None) -> torch.Tensor:
        """[batch] load-balancing terms of this rank's tokens: summed over the ranks of
        ``group`` (context parallelism), each is the sequence's ``aux``."""
        return self.from_stats(self.stage_stats(router_logits, batch), group)

    def stage_stats(self, router_logits: tuple, batch: int) -> torch.Tensor:
        """[batch, top_k + 1, num_experts]: these layers' routing of each sequence, as sums
        over layers and tokens. ``[:, k]`` counts the rows whose k-th choice is each expert
        (no gradient), ``[:, top_k]`` sums each expert's router probability (with its
        gradient). The sums of several groups of layers are those of all of them: a pipeline
        adds each stage's to what it receives and passes them on."""
        logits = torch.stack([t.float() for t in router_logits])  # [L, B*S, E]
        layers = logits.shape[0]
        probs = F.softmax(logits, dim=-1).reshape(layers, batch, -1, self.num_experts)
        _, chosen = torch.topk(probs, self.top_k, dim=-1)  # [L, B, S, k]
        counts = F.one_hot(chosen, self.num_experts).sum(dim=(0, 2)).float()  # [B, k, E]
        return torch.cat([counts, probs.sum(dim=(0, 2))[:, None, :]], dim=1)

    def from_stats(self, stats: torch.Tensor, group=None) -> torch.Tensor:
        """[batch] ``aux`` of each sequence from the sums of all its layers
        (:meth:`stage_stats`); under context parallelism the counts are summed over
        ``group`` and the probabilities stay this rank's part."""
        counts = stats[:, :-1].detach()  # [B, k, E]
        if group is not None:  # the sequence's counts over all its ranks
            counts = counts.clone()
            dist.all_reduce(counts, group=group)
        rows = counts[:, :1].sum(dim=-1, keepdim=True)  # [B, 1, 1]: each row picks k experts
        fraction = counts / rows  # [B, k, E]
        prob_sum = stats[:, -1]  # [B, E]: this rank's part, with its gradient
        return self.num_experts * (fraction * prob_sum[:, None, :]).sum(dim=(1, 2)) \
            / rows[:, 0, 0]


def carry_routing_sums(parts: list, router: RouterLoss) -> None:
    """Under a pipeline: each stage adds its layers' routing sums (:meth:`RouterLoss.
    stage_stats`) to those it receives and sends them on with its activations, so the last
    stage holds each sequence's sums over all layers (``pipelining/split.py``). They are
    activations: the schedule's backward takes the gradient of their probability sums back to
    every stage's routers."""
    for part in parts:
        part._pipeline_role = replace(part._pipeline_role, router_stats=router.stage_stats)
