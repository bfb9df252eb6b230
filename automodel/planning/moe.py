"""Expert parallelism for the planner: the dispatch with balanced routing.

Expert parallelism sends each (token, chosen expert) pair to the rank holding the expert;
how many go where depends on the router's choices, which fake tensors do not have (the
dispatch counts them with ``bincount`` and reads the counts on the host). The planner
replaces each experts module's dispatch (``distributed/expert_parallel._dispatch_forward``)
with the same operations on **balanced routing**: of a rank's ``tokens * top_k`` pairs, every
expert receives ``tokens * top_k / num_experts`` (the remainder, one more each, to the first
experts), from every rank alike. A real router is not balanced: its busiest expert receives
more, and its rank more memory and bytes; the plan reports the balanced case.

With that, the all-to-alls carry the balanced bytes (the count exchange of ``num_experts``
int64 values, the pairs' hidden states out and the results back; the same again in
backward), and this rank's experts compute on their balanced share through the model's own
expert computation, as in a real run.

Without expert parallelism nothing is replaced: transformers' grouped and batched experts
implementations keep static shapes (every pair goes through one grouped matmul whose offsets
only split it), which fake tensors run as they are.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

from automodel.distributed.expert_parallel import ExpertPlacement, exchange_and_combine


def balanced_counts(pairs: int, num_experts: int) -> list[int]:
    """Pairs per expert under balanced routing."""
    base, extra = divmod(pairs, num_experts)
    return [base + (e < extra) for e in range(num_experts)]


def balanced_routing(parts: list) -> int:
    """Give every expert-parallel experts module of ``parts`` the balanced dispatch; returns
    how many there are."""
    n = 0
    for part in parts:
        for module in part.modules():
            if isinstance(getattr(module, "_ep", None), ExpertPlacement):
                module.forward = types.MethodType(balanced_dispatch_forward, module)
                n += 1
    return n


def balanced_dispatch_forward(self: nn.Module, hidden_states: torch.Tensor,
                              top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """``_dispatch_forward`` with the split sizes of balanced routing (same operations and
    shapes; the counts are known on the host, so nothing is read back)."""
    ep: ExpertPlacement = self._ep
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert
    counts = balanced_counts(tokens * k, ep.num_experts)
    send = flat.new_empty((ep.ep_size, ep.num_local))  # (the count exchange: bincount's int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    local = ep.num_local
    in_splits = [sum(counts[r * local:(r + 1) * local]) for r in range(ep.ep_size)]
    mine = dist.get_rank(ep.group)
    out_splits = [in_splits[mine]] * ep.ep_size  # every rank routes its tokens alike
    local_ids = flat.new_empty(sum(out_splits))  # (each received row's local expert)
    return exchange_and_combine(self, hidden_states, top_k_weights, order, k,
                                (in_splits, out_splits), local_ids)
