"""Tensor parallelism (Megatron-style) through DTensor's ``parallelize_module``.

A plan maps FQN patterns to Hugging Face style names; this module resolves the patterns to
modules and the names to torch ``ParallelStyle`` objects. With sequence parallelism the
residual stream between TP regions stays a DTensor sharded on the sequence dim (``Shard(1)``):
embedding and row-wise outputs are reduce-scattered into it, norms run on it, and each
attention/MLP block all-gathers it on entry. Because it is a DTensor it reports the full
sequence length, so the model's own mask and position logic see the true shape.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from automodel.compat import input_embeddings
from automodel.config.tp_styles import shards_vocab, style_problem
from automodel.distributed.tp_extra_styles import (
    AllReduceOutput,
    EmbeddingColwise,
    EmbeddingRowwise,
    GatherSequenceOnEntry,
    LocalParams,
    MlaKvAProj,
    ReplicatedWithGradAllReduce,
)
from automodel.distributed.tp_heads import localize_head_counts
from automodel.distributed.tp_image_text import ShardSequenceOnEntry
from automodel.distributed.tp_lora_styles import lora_style
from automodel.models.multimodal import language_stack, text_config
from automodel.models.parts import group_of
from automodel.models.tp_plans import matches
from automodel.peft.lora import LoraLinear

log = logging.getLogger(__name__)

# Output projections whose columns are attention heads: "colwise" on them splits heads.
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn",
                     "W_pack", "q_b_proj", "kv_b_proj", "query", "key", "value")

def _style(name: str, module: nn.Module, sequence_parallel: bool,
           in_block: bool, whole_embedding: bool = False) -> ParallelStyle | None:
    """The torch style for a style name on ``module``. ``in_block``: the module sits inside a
    transformer block, where (with sequence parallelism) inputs arrive gathered and outputs
    go back to the sequence-sharded residual stream. ``whole_embedding``: the embedding's
    output stays whole under SP (an image-text model merges its images into it first)."""
    sp = sequence_parallel
    embedding = isinstance(module, nn.Embedding)
    seq_out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    sp_embedding = sp and not whole_embedding
    if name == "embedding_rowwise" or (embedding and name in ("rowwise", "rowwise_rep",
                                                               "rowwise_split_input")):
        return EmbeddingRowwise(input_layouts=Replicate(),
                                output_layouts=Shard(1) if sp_embedding else Replicate(),
                                use_local_output=not sp_embedding)
    if name == "embedding_colwise" or (embedding and name == "colwise_gather_output"):
        return EmbeddingColwise(input_layouts=Replicate(),
                                output_layouts=Shard(1) if sp_embedding else Replicate(),
                                use_local_output=not sp_embedding)
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel(**seq_out)
    if name in ("colwise_rep", "colwise_gather_output"):
        # outside the blocks (the LM head) the input is the sequence-sharded norm output
        return ColwiseParallel(input_layouts=Shard(1) if sp and not in_block else Replicate(),
                               output_layouts=Replicate())
    if name in ("rowwise_rep", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate(), **seq_out)
    if name == "sequence_parallel":
        return SequenceParallel() if sp else None  # without SP the norm stays replicated
    if name == "replicated_with_grad_allreduce":
        return ReplicatedWithGradAllReduce()
    if name == "all_reduce":
        return AllReduceOutput()
    if name == "mla_kv_a_proj":
        return MlaKvAProj()
    if name == "local_params":
        return LocalParams()
    if name == "replicate":
        return None
    raise AssertionError(f"style {name!r} passed the checks but has no translation")


# Parameter-level plan entries (a bare parameter such as attention sinks): how it is split.
_PARAM_PLACEMENTS = {"colwise": Shard(0), "rowwise": Shard(-1), "replicate": None}


def _family(model: nn.Module) -> str:
    return f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r})"


def expand_plan(model: nn.Module, plan: dict, source: str,
                allow_unmatched: bool = False) -> dict[str, str]:
    """Concrete FQN (of a module, or of a bare parameter) -> style name. Unknown or refused
    styles and patterns that match nothing are errors naming the model, the pattern and the
    style (``allow_unmatched``: a pipeline stage holds only part of the model, checked whole
    before)."""
    modules = [n for n, _ in model.named_modules() if n]
    concrete: dict[str, str] = {}
    for pattern, style in plan.items():
        problem = style_problem(style)
        if problem is not None:
            raise ValueError(f"{source} of {_family(model)}: pattern {pattern!r} uses style "
                             f"{style!r}, which {problem}")
        matched = matches(model, pattern)
        if not matched and not allow_unmatched:
            raise ValueError(f"{source} of {_family(model)}: pattern {pattern!r} matches no "
                             f"module (e.g. {', '.join(modules[:4])}, ...)")
        for n in matched:
            if n not in modules and style not in _PARAM_PLACEMENTS:
                raise ValueError(f"{source} of {_family(model)}: pattern {pattern!r} names a "
                                 f"parameter, which style {style!r} cannot split (parameters "
                                 f"take {', '.join(_PARAM_PLACEMENTS)})")
            concrete[n] = style
    return concrete


def head_split_modules(concrete: dict[str, str]) -> list[str]:
    """The attention modules whose heads the plan splits: parents of column-wise q/k/v."""
    parents = {fqn.rpartition(".")[0] for fqn, style in concrete.items()
               if style == "colwise" and fqn.rsplit(".", 1)[-1] in _HEAD_PROJECTIONS}
    return sorted(parents)


def splits_heads(concrete: dict[str, str]) -> bool:
    """Whether a resolved plan splits attention heads over the TP ranks (q/k/v colwise)."""
    return bool(head_split_modules(concrete))


def activations_with_weights(model: nn.Module, concrete: dict[str, str]) -> list[str]:
    """Activations with trainable weights (transformers' own activation classes, e.g.
    Apertus' xIELU) beside a column-wise projection and not in the plan: they run on this
    rank's features, so their weights' gradients are partial sums over the TP ranks."""
    from transformers.activations import ACT2CLS

    kinds = tuple({c[0] if isinstance(c, tuple) else c for c in ACT2CLS.values()})
    parents = {fqn.rpartition(".")[0] for fqn, style in concrete.items() if style == "colwise"}
    found = []
    for parent in sorted(parents):
        for name, child in _module_or_none(model, parent).named_children():
            fqn = f"{parent}.{name}" if parent else name
            if (isinstance(child, kinds) and fqn not in concrete
                    and any(p.requires_grad for p in child.parameters(recurse=False))):
                found.append(fqn)
    return found


def per_head_weights(model: nn.Module, concrete: dict[str, str]) -> list[str]:
    """Modules with weights of one head's width inside an attention module whose heads the
    plan splits, and not in the plan (a q/k norm per head that a family's Hugging Face plan
    leaves out, as GLM-4-MoE's and Sarvam-MoE's do): they run on this rank's heads, so their
    weights' gradients are partial sums over the TP ranks."""
    found = []
    for parent in head_split_modules(concrete):
        attention = _module_or_none(model, parent)
        head_dim = getattr(attention, "head_dim", None)
        for name, child in attention.named_children():
            fqn = f"{parent}.{name}"
            own = [p for p in child.parameters(recurse=False) if p.requires_grad]
            if (own and fqn not in concrete and not isinstance(child, nn.Linear)
                    and all(p.shape[-1] == head_dim for p in own)):
                found.append(fqn)
    return found


def check_divisibility(model: nn.Module, concrete: dict[str, str], tp: int) -> None:
    """What the plan needs of the model's sizes: heads split by TP, a vocabulary split (an
    image-text model's: its language model's config)."""

    cfg = text_config(model.config)
    if splits_heads(concrete):
        for key in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value % tp:
                raise ValueError(f"mesh.tp_size={tp} must divide the model's {key}={value} "
                                 f"({_config_key(model, key)}): the TP plan splits attention "
                                 "heads; "
                                 "choose a tp_size that divides it")
    vocab = getattr(cfg, "vocab_size", None)
    embedding, head = input_embeddings(model), model.get_output_embeddings()
    for fqn, style in concrete.items():
        module = _module_or_none(model, fqn)
        if module is None or module not in (embedding, head) or not isinstance(vocab, int):
            continue
        if shards_vocab(style, on_embedding=module is embedding) and vocab % tp:
            raise ValueError(f"mesh.tp_size={tp} must divide the model's vocab_size={vocab}: "
                             f"the TP plan splits {fqn!r} by vocabulary with {style!r}")


def _config_key(model: nn.Module, key: str) -> str:
    from automodel.models.multimodal import is_image_text

    return (f"model.config.text_config.{key}" if is_image_text(model.config)
            else f"model.config.{key}")


def plan_gap(model: nn.Module, concrete: dict[str, str], block_fqns: list[str],
             sequence_parallel: bool) -> str | None:
    """What the plan ``concrete`` leaves inconsistent in a language block's attention or MLP
    (a child holding linear layers), or None: an output projection split by its input
    (``rowwise``) with no input projection split by its output before it; under sequence
    parallelism, a child whose output is not reduced back to sequence shards (no row-wise
    projection: it would take and return the sharded stream whole)."""

    for block in [b for b in block_fqns if group_of(b) == "language"]:
        for name, child in model.get_submodule(block).named_children():
            fqn = f"{block}.{name}"
            if not any(isinstance(m, nn.Linear) for m in child.modules()):
                continue
            styles = [v for k, v in concrete.items() if k.startswith(fqn + ".")]
            if "rowwise" in styles and not any("colwise" in v and "gather" not in v
                                               for v in styles):
                return (f"{fqn} ({type(child).__name__}): the plan splits its output "
                        "projection by input ('rowwise') but none of its input projections "
                        "by output")
            if sequence_parallel and not any(v.startswith("rowwise") for v in styles):
                return (f"{fqn} ({type(child).__name__}) has no row-wise projection in the "
                        "plan, so its output cannot return to the sequence-sharded residual "
                        "stream")
    return None


def _module_or_none(model: nn.Module, fqn: str) -> nn.Module | None:
    try:
        return model.get_submodule(fqn)
    except AttributeError:  # a parameter-level entry
        return None


def _split_parameter(model: nn.Module, fqn: str, style: str, tp_mesh: DeviceMesh) -> None:
    placement = _PARAM_PLACEMENTS[style]
    if placement is None:
        return
    owner_name, _, name = fqn.rpartition(".")
    owner = model.get_submodule(owner_name)
    param = getattr(owner, name)
    owner.register_parameter(name, nn.Parameter(
        distribute_tensor(param.data, tp_mesh, [placement], src_data_rank=None),
        requires_grad=param.requires_grad))


def _sequence_parallel_extras(model: nn.Module, block_fqns: list[str],
                              concrete: dict[str, str],
                              stack: str | None) -> dict[str, ParallelStyle]:
    """Norms on the residual stream run sequence-sharded; blocks gather on entry. ``stack``:
    an image-text model's language stack (its blocks and norms only: the tower keeps whole
    sequences), which splits the sequence on entry."""
    extras: dict[str, ParallelStyle] = {}
    if stack is not None:
        extras[stack] = ShardSequenceOnEntry()
        block_fqns = [b for b in block_fqns if b.startswith(stack + ".")]
    else:
        stack = getattr(model, "base_model_prefix", "")
    base = model.get_submodule(stack) if stack else model
    parents = [(stack, base)] + [(f, model.get_submodule(f)) for f in block_fqns]
    for parent_name, parent in parents:
        for child_name, child in parent.named_children():
            fqn = f"{parent_name}.{child_name}" if parent_name else child_name
            if "norm" in type(child).__name__.lower():
                extras[fqn] = SequenceParallel()
            elif parent_name in block_fqns and any(k.startswith(fqn + ".") for k in concrete):
                extras[fqn] = GatherSequenceOnEntry()
    return extras


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict, source: str,
             block_fqns: list[str], sequence_parallel: bool, async_tp: bool,
             pipeline_stage: bool = False, vocab_parallel_head: str | None = None
             ) -> dict[str, str]:
    """Parallelize ``model`` in place over ``tp_mesh``. Returns the concrete plan applied.

    ``vocab_parallel_head``: the LM head fused with the loss (``distributed/fused_head.py``):
    its weight is split over the vocabulary and its output never gathered, whatever the
    plan says for it (the loss reduces the softmax across the ranks instead)."""
    concrete = expand_plan(model, plan, source, allow_unmatched=pipeline_stage)
    check_divisibility(model, concrete, tp_mesh.size())
    stack = language_stack(model, block_fqns) if sequence_parallel else None
    styles: dict[str, ParallelStyle] = {}
    for fqn, name in concrete.items():
        module = _module_or_none(model, fqn)
        if module is None:
            _split_parameter(model, fqn, name, tp_mesh)
            continue
        if name == "mla_kv_a_proj":
            module.rope_dim = text_config(model.config).qk_rope_head_dim
        in_block = any(fqn.startswith(b + ".") for b in block_fqns)
        # (an image-text model's tower and projector take whole images: no SP inside them)
        sp = sequence_parallel and (stack is None or group_of(fqn) not in ("vision",
                                                                           "multimodal"))
        style = (VocabParallelHead() if fqn == vocab_parallel_head
                 else _style(name, module, sp, in_block, stack is not None))
        if isinstance(module, LoraLinear) and style is not None:
            style = _with_adapters(fqn, name, style)
        if style is not None:
            styles[fqn] = style
    for fqn in activations_with_weights(model, concrete):  # (on local features: -1)
        styles.setdefault(fqn, ReplicatedWithGradAllReduce(input_dim=-1))
    for fqn in per_head_weights(model, concrete):  # (on local heads: -2)
        styles.setdefault(fqn, ReplicatedWithGradAllReduce())
    if sequence_parallel:
        for fqn, style in _sequence_parallel_extras(model, block_fqns, concrete,
                                                    stack).items():
            styles.setdefault(fqn, style)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, styles)
    for name, p in model.named_parameters():  # (torch's styles make their new parameters
        if name in frozen:  # trainable: SequenceParallel would unfreeze a frozen norm)
            p.requires_grad_(False)
    _retie_embeddings(model)
    localize_head_counts(model, head_split_modules(concrete), tp_mesh.size())
    if async_tp:
        enable_async_tp(tp_mesh)
    log.info("tensor parallel over %d ranks with %s (%d modules%s)", tp_mesh.size(), source,
             len(styles), ", sequence parallel" if sequence_parallel else "")
    return concrete


def _with_adapters(fqn: str, name: str, style: ParallelStyle) -> ParallelStyle:
    twin = lora_style(style)
    if twin is None:
        raise ValueError(f"peft: {fqn} carries LoRA adapters, and its tensor-parallel style "
                         f"{name!r} has no form that places them (column- and row-wise styles "
                         "do); take it out with peft.exclude_modules")
    return twin


class VocabParallelHead(ColwiseParallel):
    """The head's weight (and bias) split over the vocabulary (``Shard(0)``), with no input
    or output conversion: the fused loss takes the hidden states and the local rows."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition_linear_fn)


def _retie_embeddings(model: nn.Module) -> None:
    """``parallelize_module`` gives every module new parameters, which unties tied embeddings."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    inp, out = input_embeddings(model), model.get_output_embeddings()
    if inp is None or out is None or out.weight is inp.weight:
        return
    a, b = inp.weight, out.weight
    if isinstance(a, DTensor) != isinstance(b, DTensor) or (
            isinstance(a, DTensor) and a.placements != b.placements):
        raise ValueError("tied input and output embeddings got different TP shardings; give "
                         "both the same (e.g. embedding_rowwise and colwise_gather_output)")
    out.weight = inp.weight


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor overlap TP collectives with matmuls (compiled regions, CUDA only)."""
    from automodel.compat import enable_micro_pipeline_tp, enable_symmetric_memory

    enable_micro_pipeline_tp()
    if tp_mesh.device_type == "cuda":
        enable_symmetric_memory(tp_mesh.get_group().group_name)
        log.info("async tensor parallel: micro-pipelined TP and symmetric memory enabled")
    else:
        log.warning("async tensor parallel: the collective/compute overlap only happens on CUDA "
                    "(symmetric memory); on %s training runs normally without it",
                    tp_mesh.device_type)
