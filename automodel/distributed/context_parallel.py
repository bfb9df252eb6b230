"""Context parallelism: the sequence of every sample is split over the ``cp`` ranks.

``cp = ring x ulysses``. A cp rank ``c = ring_rank * ulysses + ulysses_rank`` holds two of
the ``2 * cp`` equal chunks of each sequence: chunk ``c`` and chunk ``2 * cp - 1 - c`` (causal
load balancing: an early chunk has few keys to attend to, its partner many, so every rank
does the same attention work). Everything outside attention is per token and runs on the
local tokens unchanged; RoPE gets the tokens' global positions.

Attention is the one place tokens meet. The model's attention modules call the function
registered here (through transformers' attention interface, so the model's own code runs):

1. Ulysses (all-to-all inside a ulysses group): each rank trades its sequence shard of all
   heads for the group's sequence of ``heads / ulysses`` heads.
2. Ring (all-gather over the ring group): every rank's queries get the keys and values of all
   ranks. Exact, simple, and K/V are the small tensors under grouped-query attention; the
   backward sums the key/value gradients back to their owners (a reduce-scatter).
3. Local attention of the queries against all keys with a mask built from global positions
   (causal, plus a sliding window where the layer has one).
4. Ulysses back: the output returns to the sequence shard, all heads.

Pure torch collectives with autograd, so the same code runs on gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from automodel.distributed.mesh import MeshAxis

ATTENTION_NAME = "automodel_cp"
# attention features the exchange above does not reproduce: refused by name at run time
# (and before launch where the config shows them, ``launch/preflight.py``)
UNSUPPORTED_KWARGS = {"softcap": "attention logit soft-capping",
                      "s_aux": "attention sinks", "sinks": "attention sinks",
                      "position_bias": "a learned position bias"}


# ----------------------------------------------------------------------------- collectives
class _AllGatherSeq(torch.autograd.Function):
    """Concatenate every rank's tensor along ``dim``; backward: sum-scatter the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        world = dist.get_world_size(group)
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dim 0 goes to rank ``i``; the chunk from rank ``i`` lands at ``i``.
    With equal chunks the backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _heads_to_sequence(x: torch.Tensor, group, u: int) -> torch.Tensor:
    """[B, H, S, D] (local sequence, all heads) -> [B, H/u, u*S, D] (group's sequence)."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, u, h // u, s, d).transpose(0, 1)  # [u (head group), B, H/u, S, D]
    got = _AllToAll.apply(chunks, group)  # [u (sequence shard of rank i), B, H/u, S, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)


def _sequence_to_heads(out: torch.Tensor, group, u: int) -> torch.Tensor:
    """[B, u*S, H/u, D] (attention output, group's sequence) -> [B, S, H, D]."""
    b, us, hu, d = out.shape
    s = us // u
    chunks = out.reshape(b, u, s, hu, d).transpose(0, 1)  # [u (sequence shard), B, S, H/u, D]
    got = _AllToAll.apply(chunks, group)  # [u (head group of rank i), B, S, H/u, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s, u * hu, d)


# ----------------------------------------------------------------------------- the layout
@dataclass
class ContextParallel:
    """This rank's place in the cp axis and the groups attention exchanges over."""

    ring_size: int
    ulysses_size: int
    ring_rank: int
    ulysses_rank: int
    ring_group: object = None
    ulysses_group: object = None
    _index_cache: dict = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    def _chunks(self, cp_rank: int, chunk: int) -> torch.Tensor:
        first, second = cp_rank, 2 * self.size - 1 - cp_rank
        return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                          torch.arange(second * chunk, (second + 1) * chunk)])

    def positions(self, seq_len: int, device, ranks=None) -> torch.Tensor:
        """Global positions of the tokens held by cp ``ranks`` (default: this rank), in the
        order they are held."""
        ranks = (self.rank,) if ranks is None else tuple(ranks)
        key = (seq_len, str(device), ranks)
        if key not in self._index_cache:
            chunk = seq_len // (2 * self.size)
            index = torch.cat([self._chunks(r, chunk) for r in ranks])
            self._index_cache[key] = index.to(device)
        return self._index_cache[key]

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``t`` [batch, seq, ...]."""
        return t.index_select(1, self.positions(t.shape[1], t.device))

    def local_positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens."""
        return self.positions(local_len * self.size, device)

    def query_and_key_positions(self, local_len: int, device):
        """Global positions of the queries after the Ulysses exchange (this ulysses group's
        tokens) and of the keys after the ring gather (every cp rank's tokens)."""
        seq_len = local_len * self.size
        u = self.ulysses_size
        group = range(self.ring_rank * u, (self.ring_rank + 1) * u)
        return (self.positions(seq_len, device, group),
                self.positions(seq_len, device, range(self.size)))

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask, dropout: float = 0.0,
                  scaling: float | None = None, sliding_window: int | None = None, **kwargs):
        """The attention function (transformers' interface): [B, H, S_local, D] in,
        ([B, S_local, H, D], None) out."""
        for name, what in UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise NotImplementedError(
                    f"context parallelism (mesh.cp_size={self.size}) does not support "
                    f"{what} ({type(module).__name__}); use mesh.cp_size=1 for this model")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        local_len = query.shape[2]
        u = self.ulysses_size
        if u > 1:
            query, key, value = (_heads_to_sequence(t, self.ulysses_group, u)
                                 for t in (query, key, value))
        if self.ring_size > 1:
            key = _AllGatherSeq.apply(key, 2, self.ring_group)
            value = _AllGatherSeq.apply(value, 2, self.ring_group)
        q_pos, k_pos = self.query_and_key_positions(local_len, query.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is None:
            sliding_window = getattr(module, "sliding_window", None)
        if sliding_window is not None:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        out, _ = sdpa_attention_forward(module, query, key, value, allowed[None, None],
                                        dropout=dropout, scaling=scaling, is_causal=False)
        if u > 1:
            out = _sequence_to_heads(out, self.ulysses_group, u)
        return out, None


def build_context_parallel(mesh) -> ContextParallel | None:
    """The cp layout of this rank from the device mesh (None when cp is 1)."""
    if mesh is None or mesh.size(MeshAxis.CP) == 1:
        return None
    ring, uly = mesh[MeshAxis.CP_RING], mesh[MeshAxis.CP_ULYSSES]
    return ContextParallel(ring.size(), uly.size(), ring.get_local_rank(), uly.get_local_rank(),
                           ring.get_group() if ring.size() > 1 else None,
                           uly.get_group() if uly.size() > 1 else None)


def _no_mask(*args, **kwargs):
    """The mask builder for this attention: none (the function builds its own from the global
    positions of queries and keys)."""
    return None


def apply_cp(part: nn.Module, cp: ContextParallel) -> None:
    """Route the part's attention through the exchange, and give a pipeline stage the global
    positions of its tokens."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, cp.attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    part.set_attn_implementation(ATTENTION_NAME)
    role = getattr(part, "_pipeline_role", None)
    if role is not None:
        part._pipeline_role = replace(role, positions=cp.local_positions)
