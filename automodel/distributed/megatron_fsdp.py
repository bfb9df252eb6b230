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

Applied by automodel itself, before the wrap, as for FSDP2: ``activation_checkpointing``,
``tp_plan`` and ``sequence_parallel`` (with ``mesh.tp_size`` > 1), ``autocast_dtype`` (the
step's autocast) and ``patch_is_packed_sequence``. ``check_for_nan_in_grad`` is accepted for
old configs and only warns (megatron-fsdp >= 0.5 has no such switch).
"""

from __future__ import annotations

import importlib.util

_SAME_NAME = ("overlap_grad_reduce", "overlap_param_gather", "average_in_collective",
              "calculate_per_token_loss", "disable_bucketing", "fsdp_double_buffer", "nccl_ub",
              "keep_fp8_transpose_cache", "report_nan_in_param_grad")
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


def zero_dp_strategy(value) -> str:
    """The library's name for ``parallelism.zero_dp_strategy`` (validated before)."""
    from automodel.config.validate import MEGATRON_ZERO_STRATEGIES

    return MEGATRON_ZERO_STRATEGIES.get(value, value)


def unit_module_classes(model, paths) -> list[type]:
    """``megatron_fsdp_unit_modules`` as classes: import paths, or (null) the classes the
    model names in ``_no_split_modules``."""
    if paths:
        from automodel.imports import load_object

        return [load_object(p, "parallelism.megatron_fsdp_unit_modules") for p in paths]
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(f"parallelism.megatron_fsdp_unit_modules=null: "
                         f"{type(model).__name__} names no block classes in _no_split_modules; "
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
    model, optimizer = megatron_fsdp.fully_shard(part, optimizers.optimizers[0], **kwargs)
    optimizers.parts[0], optimizers.optimizers[0] = model, optimizer
    return [model]
