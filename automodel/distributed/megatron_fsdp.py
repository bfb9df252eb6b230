"""Megatron-FSDP: NVIDIA's ``megatron-fsdp`` package as a strategy (``parallelism=megatron_fsdp``).

Install it with ``pip install -e '.[megatron]'``. It runs on NVIDIA GPUs only: its wrapper
calls ``torch.cuda`` while sharding, so on a machine without CUDA a run is refused before any
process starts (``refusal``).

Every option of ``parallelism=megatron_fsdp`` reaches the library as an argument of its
``fully_shard`` (``fully_shard_kwargs``; a test binds them against the installed signature):

=============================  ===========================================================
option                         argument of ``megatron_fsdp.fully_shard``
=============================  ===========================================================
zero_dp_strategy               zero_dp_strategy (0-3 or no_shard, optim, optim_grads,
                               optim_grads_params)
megatron_fsdp_unit_modules     fsdp_unit_modules (classes from import paths; default: the
                               model's ``_no_split_modules`` classes)
overlap_grad_reduce, overlap_param_gather, average_in_collective, calculate_per_token_loss,
disable_bucketing, fsdp_double_buffer, nccl_ub, keep_fp8_transpose_cache,
report_nan_in_param_grad       the arguments of the same names
init_fsdp_with_meta_device     init_model_with_meta_device
preserve_fp32_weights          mixed_precision_policy.main_params_dtype = float32 (false:
                               None, the model's own dtype, no separate main weights)
grad_reduce_in_fp32            mixed_precision_policy.main_grads_dtype and grad_comm_dtype =
                               float32 (false: None, the parameters' dtype)
the mesh                       device_mesh with dp_shard_dim "dp_shard_cp" (cp folded in as
                               for FSDP2), dp_outer_dim "dp_replicate" under HSDP (with
                               hybrid_fsdp_group), tp_dim "tp" with tensor parallelism
=============================  ===========================================================

Applied by automodel itself, before the wrap: ``activation_checkpointing`` (the MLP of each
block, as the reference does: ``checkpointed_mlps``), ``autocast_dtype`` (the step's autocast)
and ``patch_is_packed_sequence``. ``check_for_nan_in_grad`` is accepted for old configs and
only warns (megatron-fsdp >= 0.5 has no such switch). Tensor parallelism is refused before
launch (``mesh.tp_size`` > 1; ``tp_plan`` and ``sequence_parallel`` are accepted but unused):
no machine here can check megatron-fsdp with DTensor TP, which needs two GPUs or more.

The loss scale of a step (``grad_average_size``) follows how the library reduces gradients:
an average over the dp x cp ranks, or, with ``calculate_per_token_loss``, a sum.

The wrap pre-allocates the optimizer's state with one ``step()`` on zero gradients;
``fresh_after_warmup`` runs it at lr 0 without weight decay and resets the step count, so
the first real update is the one FSDP2 (or one process) makes.

``init_fsdp_with_meta_device``: the model stays on the meta device up to the wrap; the library
then allocates one module at a time, calling its ``reset_parameters``, which
``megatron_meta_init.py`` points at the run's initial weights.
"""

from __future__ import annotations

import importlib.util
import logging

_SAME_NAME = ("overlap_grad_reduce", "overlap_param_gather", "average_in_collective",
              "calculate_per_token_loss", "disable_bucketing", "fsdp_double_buffer", "nccl_ub",
              "keep_fp8_transpose_cache", "report_nan_in_param_grad")
log = logging.getLogger(__name__)
FIX = "use parallelism=fsdp2 (the same sharding in PyTorch itself, on any device)"


def refusal(gpus: int, backend: str | None) -> str | None:
    """Why a megatron_fsdp run cannot start here (None when it can). Needs no torch import."""
    if importlib.util.find_spec("megatron_fsdp") is None:
        return ("parallelism=megatron_fsdp needs the megatron-fsdp package, which is not "
                "installed: pip install -e '.[megatron]' (or pip install megatron-fsdp); or "
                + FIX)
    if gpus == 0:
        return ("parallelism=megatron_fsdp runs on NVIDIA GPUs only (megatron-fsdp calls "
                "torch.cuda while sharding the model) and this machine has no visible GPU "
                "(CUDA_VISIBLE_DEVICES, /dev/nvidia<N>); " + FIX)
    if backend not in (None, "nccl"):
        return (f"parallelism=megatron_fsdp communicates with NCCL, not "
                f"distributed.backend={backend}; set distributed.backend=nccl (or null)")
    return None


def refusal_for(cfg) -> str | None:
    """The strategy's run-time refusal (``cfg``: the ``TrainConfig``), checked before launch."""
    return refusal(cfg.launch.gpus, cfg.distributed.backend)


def zero_dp_strategy(value) -> str:
    """The library's name for ``parallelism.zero_dp_strategy`` (validated before)."""
    from automodel.config.enums import MEGATRON_ZERO_STRATEGIES

    return MEGATRON_ZERO_STRATEGIES.get(value, value)


def unit_module_classes(model, paths) -> list[type]:
    """``megatron_fsdp_unit_modules`` as classes: import paths, or (null) the classes the
    model's blocks are made of (``parts.block_class_names``)."""
    if paths:
        from automodel.imports import load_object

        return [load_object(p, "parallelism.megatron_fsdp_unit_modules") for p in paths]
    from automodel.models.parts import block_class_names

    names = block_class_names(model)
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(f"parallelism.megatron_fsdp_unit_modules=null: "
                         f"{type(model).__name__} names no block classes (_no_split_modules) and "
                         "holds no list of layers of one class; "
                         "list the classes to shard as units (import paths)")
    return sorted(found, key=lambda c: c.__name__)


def mixed_precision_policy(opts):
    import torch
    from megatron_fsdp import MixedPrecisionPolicy

    fp32 = torch.float32
    grads = fp32 if opts.grad_reduce_in_fp32 else None
    return MixedPrecisionPolicy(main_params_dtype=fp32 if opts.preserve_fp32_weights else None,
                                main_grads_dtype=grads, grad_comm_dtype=grads)


def fully_shard_kwargs(opts, model, mesh, *, hsdp: bool, tp: bool, device) -> dict:
    """The keyword arguments of ``megatron_fsdp.fully_shard`` (besides module and optimizer)
    for ``opts`` (a ``MegatronFSDPConfig``) on ``mesh`` (the DeviceMesh with its flattened
    ``dp_shard_cp`` dim)."""
    kwargs = {name: getattr(opts, name) for name in _SAME_NAME}
    kwargs.update(
        device_mesh=mesh, dp_shard_dim="dp_shard_cp",
        dp_outer_dim="dp_replicate" if hsdp else None, tp_dim="tp" if tp else None,
        fsdp_unit_modules=unit_module_classes(model, opts.megatron_fsdp_unit_modules),
        zero_dp_strategy=zero_dp_strategy(opts.zero_dp_strategy),
        init_model_with_meta_device=opts.init_fsdp_with_meta_device,
        mixed_precision_policy=mixed_precision_policy(opts), device=device)
    if hsdp:  # the whole dp x cp group: outer (replicate) and inner (shard) together
        kwargs["hybrid_fsdp_group"] = mesh["dp_cp"].get_group()
    return kwargs


def apply_megatron_fsdp(parts: list, optimizers, setup) -> list:
    """Wrap the model and its optimizer with ``megatron_fsdp.fully_shard`` (after TP and
    activation checkpointing, which ``parallelize`` applied). Returns the new parts; the
    optimizer is replaced inside ``optimizers``."""
    import megatron_fsdp

    from automodel.distributed.mesh import MeshAxis

    (part,) = parts  # (pipelines are refused with this strategy before launch)
    kwargs = fully_shard_kwargs(setup.options, part, setup.mesh.device_mesh,
                                hsdp=setup.mesh.dp_replicate_size > 1,
                                tp=setup.size(MeshAxis.TP) > 1, device=setup.device)
    model, optimizer = fresh_after_warmup(
        optimizers.optimizers[0], lambda opt: megatron_fsdp.fully_shard(part, opt, **kwargs))
    optimizers.parts[0], optimizers.optimizers[0] = model, optimizer
    return [model]


_WARMUP_NEUTRAL = ("lr", "weight_decay")  # what a step on zero gradients can still apply


def fresh_after_warmup(optimizer, run_warmup):
    """``run_warmup(optimizer)`` (returned), leaving ``optimizer`` as fresh as one that never
    stepped, apart from its allocated state.

    megatron-fsdp 0.6.1's ``fully_shard`` replaces the optimizer's param groups with one group
    of its own parameters (built from ``optimizer.defaults``), then pre-allocates the state
    for checkpoint loading by one ``optimizer.step()`` on zero gradients. Unneutralized, that
    step applies AdamW's weight decay once and leaves ``state["step"]`` at 1 (the first real
    update's bias correction then differs from FSDP2's). So during ``run_warmup`` every
    group's, and the defaults', ``lr`` and ``weight_decay`` are 0 (no weight moves, no decay
    reaches the moments); afterwards the groups that existed keep their own values (the lr a
    schedule has set included), groups the warm-up created take the defaults', and every
    ``state["step"]`` is 0 again, of its own type and device. Exact for optimizers whose other
    state a zero gradient leaves at its initial value (Adam, AdamW, RMSprop, Adagrad, SGD
    without dampening; not NAdam, whose mu_product moves; automodel builds AdamW)."""
    import torch

    defaults = {k: optimizer.defaults[k] for k in _WARMUP_NEUTRAL if k in optimizer.defaults}
    saved = [(g, {k: g[k] for k in _WARMUP_NEUTRAL if k in g}) for g in optimizer.param_groups]
    for target, values in [(optimizer.defaults, defaults), *saved]:
        target.update({k: v * 0 for k, v in values.items()})  # (a tensor lr stays a tensor)
    try:
        result = run_warmup(optimizer)
    finally:
        optimizer.defaults.update(defaults)
        for group, values in saved:
            group.update(values)
        old = {id(group) for group, _ in saved}  # (saved holds them: ids not reused)
        for group in optimizer.param_groups:
            if id(group) not in old:
                group.update({k: v for k, v in defaults.items() if k in group})
    for state in optimizer.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            state["step"] = torch.zeros_like(step)
        elif step is not None:
            state["step"] = type(step)(0)
    return result


def grad_average_size(opts, dp_cp: int, dp_replicate: int) -> int:
    """The number of ranks megatron-fsdp 0.6.1 divides the summed gradients by: a step scales
    each micro-batch loss by it over the global token count, so that the reduced gradient is
    the gradient of the global token mean in every mode.

    ``calculate_per_token_loss=false``: the library scales by 1 / (dp x cp) before summing, or
    averages in the collective (``average_in_collective``): the average over dp x cp ranks.
    ``true``: it sets no scaling factor and sums over the dp-shard x cp group; under HSDP its
    outer (dp_replicate) reduction then averages with ``average_in_collective`` and sums
    without (``MegatronFSDP._init_fsdp_param_and_grad_buffer``,
    ``gradient_reduce_preprocessing`` and the outer reduction in ``param_and_grad_buffer``)."""
    if not opts.calculate_per_token_loss:
        return dp_cp
    return dp_replicate if opts.average_in_collective else 1


def megatron_average_size(setup) -> int:
    """``GradSync.average_size`` of ``parallelism=megatron_fsdp`` (``setup``: the
    ``DistributedSetup``)."""
    from automodel.distributed.mesh import MeshAxis

    return grad_average_size(setup.options, setup.size(MeshAxis.DP_CP),
                             setup.size(MeshAxis.DP_REPLICATE))


def defer_megatron_sync(model, setup, is_last: bool):
    """``no_sync`` on all but the last micro-batch."""
    return None if is_last else model.no_sync()


def finish_megatron_sync(model, setup) -> None:
    """Its gradient reduction runs on after backward; clipping needs it done."""
    model.finish_grad_sync()


def attention_classes(model) -> set[type]:
    """The attention module classes the model declares (transformers' ``_can_record_outputs``
    ``attentions`` entry, per sub-model: the language model and a vision tower each)."""
    found = set()
    for module in model.modules():
        target = (getattr(type(module), "_can_record_outputs", None) or {}).get("attentions")
        target = getattr(target, "target_class", target)  # (an OutputRecorder, or the class)
        if isinstance(target, type):
            found.add(target)
    return found


def checkpointed_mlps(model, blocks: list[str]) -> list[str]:
    """What ``activation_checkpointing=true`` wraps under megatron_fsdp, as the reference
    does: the MLP of each block, not the whole block. A block's MLP is found from its
    structure: the child modules holding weight matrices (or expert tensors) other than the
    attention module the model declares; norms, dropouts and embeddings are not MLPs. A block
    without a declared attention child (an embedding unit) has no MLP; when the model declares
    no attention class at all, its whole blocks are wrapped, with a warning."""
    from torch import nn

    attention = attention_classes(model)
    if not attention:
        log.warning("activation_checkpointing=true: %s declares no attention class "
                    "(_can_record_outputs); its MLP layers cannot be told apart, so whole "
                    "blocks are checkpointed", type(model).__name__)
        return list(blocks)
    found = []
    for fqn in blocks:
        children = list(model.get_submodule(fqn).named_children())
        if not any(isinstance(child, tuple(attention)) for _, child in children):
            continue
        found += [f"{fqn}.{name}" for name, child in children
                  if not isinstance(child, (*attention, nn.Embedding))
                  and any(p.dim() >= 2 for p in child.parameters())]
    return found
