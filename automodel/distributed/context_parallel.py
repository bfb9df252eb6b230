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
   ranks, put back in sequence order. Exact, simple, and K/V are the small tensors under
   grouped-query attention; the backward sums the key/value gradients back to their owners
   (a reduce-scatter).
3. Each query chunk attends to the keys up to its own end: earlier chunks in full, its own
   chunk causally (a lower-right causal block). Keys a query may not see are never touched,
   so a rank does its share of the causal work and no sequence-by-sequence mask exists. On
   CUDA the diagonal block is the flash kernel's own causal mode; on CPU, and for sliding
   windows, a chunk-sized mask is built once and shared by every layer and step.
4. Ulysses back: the output returns to the sequence shard, all heads.

Pure torch collectives with autograd, so the same code runs on gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from automodel.compat import can_set_attn_implementation
from automodel.distributed.mesh import MeshAxis

ATTENTION_NAME = "automodel_cp"
# attention features the exchange above does not reproduce: refused by name at run time
# (and before launch where the config shows them, ``checks/preflight.py``)
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
    cp_group: object = None  # all cp ranks of this rank's sequences
    # an image-text model takes whole sequences (its images merge on them) and its language
    # model splits them (``tp_image_text.split_sequence_on_entry``); labels are split here
    whole_inputs: bool = False
    _index_cache: dict = field(default_factory=dict, repr=False)  # positions, masks

    @property
    def size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    def positions(self, seq_len: int, device) -> torch.Tensor:
        """Global positions of this rank's tokens of a ``seq_len`` sequence, in order."""
        key = ("positions", seq_len, str(device))
        if key not in self._index_cache:
            chunk = seq_len // (2 * self.size)
            first, second = self.rank, 2 * self.size - 1 - self.rank
            self._index_cache[key] = torch.cat([
                torch.arange(first * chunk, (first + 1) * chunk),
                torch.arange(second * chunk, (second + 1) * chunk)]).to(device)
        return self._index_cache[key]

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``t`` [batch, seq, ...]."""
        return t.index_select(1, self.positions(t.shape[1], t.device))

    def local_positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens."""
        return self.positions(local_len * self.size, device)

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
        u = self.ulysses_size
        if u > 1:
            query, key, value = (_heads_to_sequence(t, self.ulysses_group, u)
                                 for t in (query, key, value))
        if self.ring_size > 1:
            key = _AllGatherSeq.apply(key, 2, self.ring_group)
            value = _AllGatherSeq.apply(value, 2, self.ring_group)
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1:  # grouped-query attention: each KV head serves `groups` query heads
            key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        key, value = self._in_global_order(key), self._in_global_order(value)
        if sliding_window is None:
            sliding_window = getattr(module, "sliding_window", None)
        out = self._chunked_causal(query, key, value, dropout, scaling, sliding_window)
        out = out.transpose(1, 2)  # [B, S, H, D]
        if u > 1:
            out = _sequence_to_heads(out, self.ulysses_group, u)
        return out.contiguous(), None

    def _query_chunks(self) -> list[int]:
        """Global chunk indices of the queries after the Ulysses exchange, in order."""
        u, n = self.ulysses_size, 2 * self.size
        return [c for r in range(self.ring_rank * u, (self.ring_rank + 1) * u)
                for c in (r, n - 1 - r)]

    def _in_global_order(self, t: torch.Tensor) -> torch.Tensor:
        """Gathered keys/values [B, H, 2*cp*chunk, D] (rank order: each rank's two chunks)
        -> global sequence order."""
        b, h, total, d = t.shape
        n = 2 * self.size
        key = ("order", str(t.device))
        if key not in self._index_cache:  # (made once: no host-to-device copy per layer)
            order = [2 * c if c < self.size else 2 * (n - 1 - c) + 1 for c in range(n)]
            self._index_cache[key] = torch.tensor(order, device=t.device)
        index = self._index_cache[key]
        return t.reshape(b, h, n, total // n, d).index_select(2, index).reshape(b, h, total, d)

    def _chunked_causal(self, query, key, value, dropout, scaling, window):
        """Each query chunk against the keys before it: no key that the causal mask hides is
        ever multiplied. The diagonal block is causal aligned to its lower right; on CUDA
        that is the flash kernel's own causal mode (no mask tensor); elsewhere, and for
        sliding windows, a mask shared by every layer and step."""
        n = 2 * self.size
        chunk = key.shape[2] // n
        outs = []
        for i, c in enumerate(self._query_chunks()):
            q = query[:, :, i * chunk:(i + 1) * chunk]
            end = (c + 1) * chunk
            start = 0 if window is None else max(0, c * chunk - window + 1)
            mask = self._mask(chunk, start, end, window, query)
            outs.append(F.scaled_dot_product_attention(
                q, key[:, :, start:end], value[:, :, start:end], attn_mask=mask,
                dropout_p=dropout, scale=scaling))
        return torch.cat(outs, dim=2)

    def _mask(self, chunk: int, start: int, end: int, window, like: torch.Tensor):
        """Which keys [start, end) the last ``chunk`` queries (positions end-chunk..end-1)
        see: causal, and within ``window`` when set."""
        if window is None and like.device.type == "cuda":
            from torch.nn.attention.bias import causal_lower_right  # (imports dynamo: on use)
            return causal_lower_right(chunk, end - start)
        key = ("mask", chunk, start, end, window, str(like.device), like.dtype)
        if key not in self._index_cache:
            q_pos = torch.arange(end - chunk, end, device=like.device)[:, None]
            k_pos = torch.arange(start, end, device=like.device)[None, :]
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            mask = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device)
            self._index_cache[key] = mask.masked_fill_(~allowed, float("-inf"))
        return self._index_cache[key]


def check_model(model: nn.Module, cp: int, ulysses: int, tp_heads: int) -> None:
    """Raise ``ValueError`` if the model's attention cannot be split this way: its heads
    (after ``tp_heads``-way tensor parallelism) over the Ulysses ranks, or a feature the
    exchange does not reproduce. Run before launch on the meta model."""
    from automodel.distributed.tp_image_text import context_parallel_refusal
    from automodel.models.multimodal import text_config

    cfg = text_config(model.config)
    where = f"mesh.cp_size={cp}"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{where}: context parallelism does not support attention logit "
                         f"soft-capping (model.config.attn_logit_softcapping="
                         f"{cfg.attn_logit_softcapping}); use mesh.cp_size=1 for this model")
    if not getattr(cfg, "is_causal", True):
        raise ValueError(f"{where}: context parallelism supports causal attention only "
                         "(model.config.is_causal=false); use mesh.cp_size=1")
    sinks = [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in ("sinks", "s_aux")]
    if sinks:
        raise ValueError(f"{where}: context parallelism does not support attention sinks "
                         f"({sinks[0]}); use mesh.cp_size=1 for this model")
    if not can_set_attn_implementation(model):
        raise ValueError(f"{where}: {type(model).__name__} does not run its attention through "
                         "transformers' attention interface, which context parallelism "
                         "replaces; use mesh.cp_size=1 for this model")
    why = _token_mixing_refusal(model, cfg) or context_parallel_refusal(model)
    if why:
        raise ValueError(f"{where}: {type(model).__name__} {why}; use mesh.cp_size=1 for "
                         "this model")
    if ulysses == 1:
        return
    heads = cfg.num_attention_heads
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(cfg, key, None) or heads
        local = value // tp_heads
        if local % ulysses:
            split = (f" / mesh.tp_size={tp_heads} = {local} per TP rank" if tp_heads > 1
                     else "")
            raise ValueError(
                f"mesh.cp_ulysses_size={ulysses} must divide the attention heads: the model "
                f"has {key}={value}{split}; choose a cp_ulysses_size that divides {local} "
                "(the rest of mesh.cp_size runs as ring)")


def _token_mixing_refusal(model: nn.Module, cfg) -> str | None:
    """What in the model mixes tokens outside causal attention, which the exchange splits
    (each rank would see only its own tokens there); None: nothing."""
    kinds = set(getattr(cfg, "layer_types", None) or ()) - {"full_attention",
                                                            "sliding_attention"}
    if kinds:
        return (f"has layers of type {', '.join(sorted(kinds))} (layer_types), which mix "
                "tokens outside the attention that context parallelism exchanges")
    if getattr(cfg, "use_bidirectional_attention", False):
        return ("attends both ways (use_bidirectional_attention=true); the context-parallel "
                "attention is causal only")
    indexers = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] == "indexer"]
    if indexers:
        return (f"chooses each query's keys with a token indexer ({indexers[0]}), which reads "
                "the whole sequence")
    return None


def build_context_parallel(mesh) -> ContextParallel | None:
    """The cp layout of this rank from the device mesh (None when cp is 1)."""
    if mesh is None or mesh.size(MeshAxis.CP) == 1:
        return None
    ring, uly = mesh[MeshAxis.CP_RING], mesh[MeshAxis.CP_ULYSSES]
    return ContextParallel(ring.size(), uly.size(), ring.get_local_rank(), uly.get_local_rank(),
                           ring.get_group() if ring.size() > 1 else None,
                           uly.get_group() if uly.size() > 1 else None,
                           mesh[MeshAxis.CP].get_group())


def _no_mask(*args, **kwargs):
    """The mask builder for this attention: none (the function builds its own from the global
    positions of queries and keys)."""
    return None


def apply_cp(part: nn.Module, cp: ContextParallel) -> None:
    """Route the part's attention through the exchange, and give a pipeline stage the global
    positions of its tokens."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from automodel.distributed.tp_image_text import split_sequence_on_entry
    from automodel.models.multimodal import language_stack
    from automodel.models.parts import block_fqns

    AttentionInterface.register(ATTENTION_NAME, cp.attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    stack = language_stack(part, block_fqns(part))
    if stack is None:
        part.set_attn_implementation(ATTENTION_NAME)
    else:  # (the tower's attention stays its own: whole images on every cp rank)
        part.get_submodule(stack).set_attn_implementation(ATTENTION_NAME)
        split_sequence_on_entry(part.get_submodule(stack), cp)
        cp.whole_inputs = True
    role = getattr(part, "_pipeline_role", None)
    if role is not None:
        part._pipeline_role = replace(role, positions=cp.local_positions)
