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
import re

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from automodel.config.validate import TP_STYLE_NAMES as STYLE_NAMES

log = logging.getLogger(__name__)

_VOCAB_SHARDING = ("colwise", "colwise_rep", "colwise_gather_output", "embedding_rowwise",
                   "rowwise", "rowwise_rep")


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module (e.g. Qwen3's per-head q/k norm) that runs on TP-local heads with weights
    replicated over TP: the input is seen as sharded on the head dim (-2), so the weight's
    gradient is summed over the TP ranks."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def replicate_params(name, mod, mesh):
            for p_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(
                    DTensor.from_local(param, mesh, [Replicate()], run_check=False)))

        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                         for x in inputs)

        def to_local(mod, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, mesh, replicate_params, to_dtensor, to_local)


class GatherSequenceOnEntry(ParallelStyle):
    """Sequence parallelism: all-gather the ``Shard(1)`` residual stream into a full local
    tensor before an attention or MLP block (positional or ``hidden_states=`` argument)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def gather(x):
            if isinstance(x, DTensor):
                return x.redistribute(placements=[Replicate()]).to_local()
            return x

        def hook(mod, args, kwargs):
            if args:
                args = (gather(args[0]),) + tuple(args[1:])
            if "hidden_states" in kwargs:
                kwargs = dict(kwargs, hidden_states=gather(kwargs["hidden_states"]))
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _style(name: str, module: nn.Module, sequence_parallel: bool) -> ParallelStyle | None:
    sp = sequence_parallel
    embedding = isinstance(module, nn.Embedding)
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        if embedding:
            return RowwiseParallel(input_layouts=Replicate(),
                                   output_layouts=Shard(1) if sp else Replicate(),
                                   use_local_output=not sp)
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp \
            else RowwiseParallel()
    if name in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                               output_layouts=Replicate())
    if name == "rowwise_rep":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate(),
                               output_layouts=Shard(1) if sp else Replicate(),
                               use_local_output=not sp)
    if name == "sequence_parallel":
        return SequenceParallel() if sp else None  # without SP the norm stays replicated
    if name == "replicated_with_grad_allreduce":
        return ReplicatedWithGradAllReduce()
    raise AssertionError(name)


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part)
                                 for part in pattern.split(".")) + "$")


def expand_plan(model: nn.Module, plan: dict, source: str,
                allow_unmatched: bool = False) -> dict[str, str]:
    """Concrete FQN -> style name. Unknown styles and patterns that match nothing are errors
    (``allow_unmatched``: a pipeline stage holds only part of the model, checked whole before)."""
    names = [n for n, _ in model.named_modules() if n]
    prefix = getattr(model, "base_model_prefix", "")
    concrete: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLE_NAMES:
            raise ValueError(f"{source}: style {style!r} for pattern {pattern!r} is not known; "
                             f"allowed: {', '.join(STYLE_NAMES)}")
        regex = _pattern_regex(pattern)
        matched = [n for n in names if regex.match(n)]
        if not matched and prefix:
            regex = _pattern_regex(f"{prefix}.{pattern}")
            matched = [n for n in names if regex.match(n)]
        if not matched and not allow_unmatched:
            raise ValueError(f"{source}: pattern {pattern!r} matches no module of "
                             f"{type(model).__name__} (e.g. {', '.join(names[:4])}, ...)")
        for n in matched:
            concrete[n] = style
    return concrete


def check_divisibility(model: nn.Module, concrete: dict[str, str], tp: int) -> None:
    """Facts of the live model that TP needs (resolve.py checks the same from the config)."""
    cfg = model.config
    heads, kv_heads = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if heads and heads % tp:
        raise ValueError(f"mesh.tp_size={tp} must divide the model's num_attention_heads={heads}")
    if kv_heads and kv_heads % tp:
        raise ValueError(f"mesh.tp_size={tp} must divide the model's num_key_value_heads={kv_heads}")
    vocab = getattr(cfg, "vocab_size", None)
    vocab_modules = {model.get_input_embeddings(), model.get_output_embeddings()} - {None}
    for fqn, style in concrete.items():
        if model.get_submodule(fqn) in vocab_modules and style in _VOCAB_SHARDING and vocab % tp:
            raise ValueError(f"mesh.tp_size={tp} must divide the model's vocab_size={vocab} "
                             f"(the plan shards {fqn!r} with {style!r})")


def _sequence_parallel_extras(model: nn.Module, block_fqns: list[str],
                              concrete: dict[str, str]) -> dict[str, ParallelStyle]:
    """Norms on the residual stream run sequence-sharded; blocks gather on entry."""
    extras: dict[str, ParallelStyle] = {}
    base = model.get_submodule(model.base_model_prefix) if getattr(model, "base_model_prefix", "") else model
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    parents = [(prefix.rstrip("."), base)] + [(f, model.get_submodule(f)) for f in block_fqns]
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
             pipeline_stage: bool = False) -> dict[str, str]:
    """Parallelize ``model`` in place over ``tp_mesh``. Returns the concrete plan applied."""
    concrete = expand_plan(model, plan, source, allow_unmatched=pipeline_stage)
    check_divisibility(model, concrete, tp_mesh.size())
    styles: dict[str, ParallelStyle] = {}
    for fqn, name in concrete.items():
        style = _style(name, model.get_submodule(fqn), sequence_parallel)
        if style is not None:
            styles[fqn] = style
    if sequence_parallel:
        for fqn, style in _sequence_parallel_extras(model, block_fqns, concrete).items():
            styles.setdefault(fqn, style)
    parallelize_module(model, tp_mesh, styles)
    _retie_embeddings(model)
    if async_tp:
        enable_async_tp(tp_mesh)
    log.info("tensor parallel over %d ranks with %s (%d modules%s)", tp_mesh.size(), source,
             len(styles), ", sequence parallel" if sequence_parallel else "")
    return concrete


def _retie_embeddings(model: nn.Module) -> None:
    """``parallelize_module`` gives every module new parameters, which unties tied embeddings."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
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
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
    if tp_mesh.device_type == "cuda":
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
        log.info("async tensor parallel: micro-pipelined TP and symmetric memory enabled")
    else:
        log.warning("async tensor parallel: the collective/compute overlap only happens on CUDA "
                    "(symmetric memory); on %s training runs normally without it",
                    tp_mesh.device_type)
