"""The one home of tensor-parallel style names (torch-free).

Plans name styles as Hugging Face's tensor-parallel integration does
(``transformers.distributed.tensor_parallel``, table ``ALL_PARALLEL_STYLES``). Every name of
that table known when this one was written is listed here: either automodel translates it to
torch ``ParallelStyle`` objects (``automodel/distributed/tensor_parallel.py``), or it is refused
before launch with the reason. A style a newer transformers adds (within the pinned range) is
refused before launch as unknown, naming it, until it is listed here; the tests check that
rule on whatever version is installed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPStyle:
    name: str
    meaning: str
    # Whether this style splits the vocabulary across the TP ranks (so tp_size must divide
    # vocab_size) when it is applied to the token embedding / to the (linear) LM head.
    vocab_on_embedding: bool = False
    vocab_on_head: bool = False
    refused: str | None = None  # why automodel cannot run it; None = translated


_EXPERTS = ("tensor-parallel expert layers (MoE) are not supported yet; give parallelism.tp_plan "
            "without the expert entries, or use mesh.tp_size=1")

_EP = ("an expert-parallel style (of base_model_ep_plan), not a tensor-parallel one; expert "
       "parallelism is not available yet")

TP_STYLES: dict[str, TPStyle] = {s.name: s for s in (
    TPStyle("colwise", "linear: output features split, input replicated; embedding: hidden "
            "dim split", vocab_on_head=True),
    TPStyle("rowwise", "linear: input features split, output summed; embedding: vocabulary "
            "split", vocab_on_embedding=True),
    TPStyle("colwise_rep", "colwise with the output gathered (replicated)", vocab_on_head=True),
    TPStyle("colwise_gather_output", "colwise with the output gathered (replicated)",
            vocab_on_head=True),
    TPStyle("rowwise_rep", "rowwise on a replicated input (split on entry), output summed",
            vocab_on_embedding=True),
    TPStyle("rowwise_split_input", "rowwise on a replicated input (split on entry), output "
            "summed", vocab_on_embedding=True),
    TPStyle("embedding_rowwise", "embedding: vocabulary split, lookups summed",
            vocab_on_embedding=True),
    TPStyle("embedding_colwise", "embedding: hidden dim split, vectors gathered"),
    TPStyle("sequence_parallel", "norm on the sequence-sharded residual (only with "
            "parallelism.sequence_parallel=true; replicated otherwise)"),
    TPStyle("replicated_with_grad_allreduce", "replicated weights used on TP-local heads; "
            "gradients summed over TP"),
    TPStyle("all_reduce", "the module's output is partial: summed over TP"),
    TPStyle("replicate", "every rank keeps the whole parameter (no sharding)"),
    TPStyle("local_params", "the module computes with its parameters' local shards (e.g. "
            "per-head attention sinks split with colwise)"),
    TPStyle("mla_kv_a_proj", "multi-head latent attention: the rotary part of the KV "
            "projection bypasses the sharded up-projection; its gradient is summed over TP"),
    TPStyle("packed_colwise", "fused expert weights split along packed outputs", refused=_EXPERTS),
    TPStyle("packed_rowwise", "fused expert weights split along packed inputs", refused=_EXPERTS),
    TPStyle("moe_tp_experts", "every rank runs its shard of every expert", refused=_EXPERTS),
    TPStyle("moe_identity_expert", "identity experts pre-divided by the TP size",
            refused=_EXPERTS),
    # transformers registers its expert-parallel styles (base_model_ep_plan) in the same table
    TPStyle("grouped_gemm", "expert parallelism: local experts as one grouped matmul",
            refused=_EP),
    TPStyle("ep_dispatch_experts", "expert parallelism: tokens dispatched to expert ranks",
            refused=_EP),
)}

# Names a plan may use that automodel can run.
TP_STYLE_NAMES = tuple(name for name, s in TP_STYLES.items() if s.refused is None)


def style_problem(style: str) -> str | None:
    """Why a plan cannot use ``style`` (unknown or refused), or None."""
    info = TP_STYLES.get(style)
    if info is None:
        return f"is not a known tensor-parallel style; allowed: {', '.join(TP_STYLE_NAMES)}"
    return info.refused


def shards_vocab(style: str, on_embedding: bool) -> bool:
    """Does ``style`` split the vocabulary when applied to the embedding (``on_embedding``)
    or to the LM head?"""
    info = TP_STYLES.get(style)
    if info is None:
        return False
    return info.vocab_on_embedding if on_embedding else info.vocab_on_head
