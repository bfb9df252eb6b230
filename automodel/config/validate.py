"""Validation rules that need only numbers and names (no torch, no processes).

Each function checks one section (or a pair of sections that constrain each other) and raises
``ConfigError`` naming the key, the value and what is allowed. ``resolve.py`` calls them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import List

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.launch.env import LaunchEnv
from automodel.models.tp_styles import style_problem

log = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")

# The layer groups a model's blocks fall into (models/parts.py assigns them): the scopes of
# activation checkpointing and the groups model.freeze takes. Here, torch-free, for the checks.
LAYER_GROUPS = ("language", "vision", "audio", "multimodal")
AC_SCOPES = LAYER_GROUPS
VISION_UNITS = ("layer", "tower")
LOSSES = ("auto", "fused", "plain")
# Strategies that need more than one data-parallel rank to mean anything (default dp = 2).
MULTI_RANK_STRATEGIES = ("ddp", "fsdp2", "megatron_fsdp")


MEGATRON_ZERO_STRATEGIES = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def _positive(path: str, value, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"{path}={value}: must be >= {minimum}")


def check_dtype(path: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value not in DTYPE_NAMES:
        raise ConfigError(f"{path}={value!r}: not a dtype name; allowed: {', '.join(DTYPE_NAMES)}"
                          + (" or null" if allow_none else ""))


def check_distributed(d: s.DistributedConfig) -> None:
    if d.backend is not None and d.backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise ConfigError(f"distributed.backend={d.backend!r}: allowed: gloo, nccl, mpi, ucc, "
                          "xccl, or null (nccl with CUDA, else gloo)")
    _positive("distributed.timeout_minutes", d.timeout_minutes)
    _positive("distributed.startup_timeout_minutes", d.startup_timeout_minutes)
    _positive("distributed.nproc_per_node", d.nproc_per_node)
    _positive("distributed.stop_grace_seconds", d.stop_grace_seconds, 0)


def resolve_mesh(strategy: str, m: s.MeshConfig, launch: LaunchEnv, d: s.DistributedConfig,
                  pipeline_chosen: bool) -> s.MeshConfig:
    for name in ("dp_size", "dp_replicate_size", "tp_size", "cp_size", "cp_ulysses_size",
                 "pp_size", "ep_size"):
        _positive(f"mesh.{name}", getattr(m, name))
    pp = m.pp_size if m.pp_size is not None else (2 if pipeline_chosen else 1)
    if pipeline_chosen and pp == 1:
        raise ConfigError("mesh.pp_size=1 with a pipeline schedule: a pipeline needs "
                          "mesh.pp_size >= 2, or choose pipeline=none")
    if not pipeline_chosen and pp > 1:
        raise ConfigError(f"mesh.pp_size={pp} needs a pipeline schedule: add pipeline=1f1b "
                          "(or another file of conf/pipeline/)")
    replicate = m.dp_replicate_size or 1
    non_dp = m.tp_size * m.cp_size * pp
    # Local ranks that init_distributed puts one per GPU (cuda:LOCAL_RANK): backend nccl, which
    # null means when GPUs are visible. torchrun and SLURM place their ranks themselves.
    gpus = launch.gpus
    on_gpus = (launch.kind == "local" and strategy != "none"
               and (d.backend or ("nccl" if gpus else "gloo")) == "nccl")
    from_gpus = False
    world = launch.world_size
    if (world is not None and d.nproc_per_node is not None
            and d.nproc_per_node != launch.local_world_size):
        log.warning("distributed.nproc_per_node=%s ignored: %s started %s processes on this node",
                    d.nproc_per_node, launch.kind, launch.local_world_size)
    if world is None:
        world = d.nproc_per_node
    if world is None:
        if m.dp_size is not None:
            dp = m.dp_size
        elif on_gpus and gpus >= non_dp:  # one rank per visible GPU
            if gpus % non_dp:
                raise ConfigError(
                    f"the {gpus} visible GPUs (CUDA_VISIBLE_DEVICES, /dev/nvidia<N>) cannot "
                    "be split into data-parallel groups of "
                    f"mesh.tp_size*cp_size*pp_size = {m.tp_size}*{m.cp_size}*{pp} = {non_dp} "
                    "ranks; set distributed.nproc_per_node (a multiple of "
                    f"{non_dp}, at most {gpus}) or mesh.dp_size to use fewer GPUs")
            dp, from_gpus = gpus // non_dp, True
        elif replicate > 1:
            dp = 2 * replicate
        elif strategy in MULTI_RANK_STRATEGIES and non_dp == 1:
            dp = 2
        else:
            dp = 1
    else:
        source = (f"distributed.nproc_per_node={world}" if launch.kind == "local"
                  else f"the world size {world} set by {launch.kind}")
        if world % non_dp:
            raise ConfigError(f"{source} is not divisible by mesh.tp_size * mesh.cp_size * "
                              f"mesh.pp_size = {m.tp_size}*{m.cp_size}*{pp} = {non_dp}")
        dp = world // non_dp
        if m.dp_size is not None and m.dp_size != dp:
            raise ConfigError(
                f"mesh sizes multiply to mesh.dp_size*tp*cp*pp = {m.dp_size}*{m.tp_size}*"
                f"{m.cp_size}*{pp} = {m.dp_size * non_dp}, but {source}; set mesh.dp_size={dp} "
                "or null (inferred), or change the process count")
    if strategy == "none" and dp * non_dp > 1:
        raise ConfigError(f"parallelism=none runs one process but the mesh asks for "
                          f"{dp * non_dp} ranks (dp={dp}, tp={m.tp_size}, cp={m.cp_size}, "
                          f"pp={pp}); choose parallelism=ddp or fsdp2")
    ranks = dp * non_dp
    if on_gpus and ranks > gpus:
        asked = (f"distributed.nproc_per_node={d.nproc_per_node}" if d.nproc_per_node is not None
                 else f"the mesh (mesh.dp_size*tp_size*cp_size*pp_size = {dp}*{m.tp_size}*"
                      f"{m.cp_size}*{pp})")
        backend = (f"distributed.backend={d.backend}" if d.backend
                   else "distributed.backend=null (nccl when GPUs are visible)")
        raise ConfigError(
            f"{asked} asks for {ranks} local ranks but {_gpus(gpus)}, and {backend} "
            "runs one rank per GPU; "
            + (f"use at most {gpus} ranks (e.g. "
               + (f"mesh.dp_size={gpus // non_dp}" if m.dp_size is not None
                  and d.nproc_per_node is None
                  else f"distributed.nproc_per_node={gpus // non_dp * non_dp}")
               + ") or " if gpus >= non_dp else "")
            + "use distributed.backend=gloo (ranks on CPU)")
    if replicate > 1:
        if strategy not in ("fsdp2", "megatron_fsdp"):
            raise ConfigError(f"mesh.dp_replicate_size={replicate} is HSDP and needs "
                              f"parallelism=fsdp2 (or hsdp, or megatron_fsdp), not "
                              f"parallelism={strategy}")
        if dp % replicate:
            raise ConfigError(f"mesh.dp_replicate_size={replicate} must divide the data-parallel "
                              f"size dp={dp}"
                              + (f" (one rank per GPU: {_gpus(gpus)})" if from_gpus
                                 else ""))
    if strategy == "ddp":
        for name, value in (("tp_size", m.tp_size), ("cp_size", m.cp_size), ("pp_size", pp),
                            ("ep_size", m.ep_size)):
            if value > 1:
                raise ConfigError(f"mesh.{name}={value}: parallelism=ddp only replicates data; "
                                  "use parallelism=fsdp2 for tensor/context/pipeline/expert "
                                  "parallelism")
    if strategy == "megatron_fsdp":
        for name, value in (("pp_size", pp), ("ep_size", m.ep_size)):
            if value > 1:
                raise ConfigError(f"mesh.{name}={value}: parallelism=megatron_fsdp does not "
                                  "support pipeline or expert parallelism; use parallelism=fsdp2")
        if m.tp_size > 1:
            raise ConfigError(f"mesh.tp_size={m.tp_size}: parallelism=megatron_fsdp is not "
                              "available with tensor parallelism in this version (untested: "
                              "it needs two GPUs or more); set mesh.tp_size=1, or use "
                              "parallelism=fsdp2 for TP (with FSDP2 or HSDP)")
    if m.cp_ulysses_size is not None and m.cp_size % m.cp_ulysses_size:
        raise ConfigError(f"mesh.cp_ulysses_size={m.cp_ulysses_size} must divide "
                          f"mesh.cp_size={m.cp_size} (cp = ring x ulysses)")
    if (dp * m.cp_size * m.tp_size) % m.ep_size:
        raise ConfigError(f"mesh.ep_size={m.ep_size} must divide dp*cp*tp = "
                          f"{dp * m.cp_size * m.tp_size} (experts are folded over those ranks)")
    return dataclasses.replace(m, dp_size=dp, dp_replicate_size=replicate, pp_size=pp)


def _gpus(n: int) -> str:
    return (f"{n} GPU{'' if n == 1 else 's'} {'is' if n == 1 else 'are'} visible "
            "(CUDA_VISIBLE_DEVICES, /dev/nvidia<N>)")


def resolve_trainer(t: s.TrainerConfig, mesh: s.MeshConfig) -> s.TrainerConfig:
    for name in ("max_steps", "global_batch_size", "local_batch_size", "seq_len", "log_every"):
        _positive(f"trainer.{name}", getattr(t, name))
    cp = mesh.cp_size
    if cp > 1 and t.seq_len % (2 * cp):
        fit = t.seq_len // (2 * cp) * 2 * cp
        raise ConfigError(
            f"trainer.seq_len={t.seq_len} must be divisible by 2 * mesh.cp_size = {2 * cp}: "
            f"each of the {cp} context-parallel ranks holds two equal chunks of every sequence; "
            f"use trainer.seq_len={fit or 2 * cp}"
            + (f" or {fit + 2 * cp}" if fit else ""))
    dp = mesh.dp_size
    local = t.local_batch_size
    if local is None:
        if t.global_batch_size % dp:
            raise ConfigError(f"trainer.global_batch_size={t.global_batch_size} must be divisible "
                              f"by the data-parallel size dp={dp}")
        local = t.global_batch_size // dp
    if t.global_batch_size % (local * dp):
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} must be divisible by "
            f"trainer.local_batch_size * dp = {local}*{dp} = {local * dp} (the remainder would "
            "be silently dropped); change one of them")
    return dataclasses.replace(t, local_batch_size=local)


def check_pre_shard_hook(par) -> None:
    """``parallelism.pre_shard_hook`` must import and be callable (the import runs here)."""
    path = getattr(par, "pre_shard_hook", None)
    if path is None:
        return
    from automodel.imports import load_object

    try:
        hook = load_object(path, "parallelism.pre_shard_hook")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not callable(hook):
        raise ConfigError(f"parallelism.pre_shard_hook={path!r} is a {type(hook).__name__}, "
                          "not a function of one model part")


def check_ac_and_strategy(strategy: str, par, mesh: s.MeshConfig):
    check_pre_shard_hook(par)
    ac = par.activation_checkpointing
    if strategy == "megatron_fsdp":
        mode, scope = ("full" if ac else "none"), ["all"]
        z = par.zero_dp_strategy
        if z not in MEGATRON_ZERO_STRATEGIES and z not in MEGATRON_ZERO_STRATEGIES.values():
            raise ConfigError(f"parallelism.zero_dp_strategy={z!r}: allowed: 0, 1, 2, 3 or "
                              f"{', '.join(MEGATRON_ZERO_STRATEGIES.values())}")
        if par.init_fsdp_with_meta_device and MEGATRON_ZERO_STRATEGIES.get(z, z) == "no_shard":
            raise ConfigError(f"parallelism.init_fsdp_with_meta_device=true with "
                              f"parallelism.zero_dp_strategy={z!r}: megatron-fsdp initializes "
                              "from the meta device only into sharded weights; set "
                              "init_fsdp_with_meta_device=false, or zero_dp_strategy 1-3")
        if par.check_for_nan_in_grad:
            log.warning("parallelism.check_for_nan_in_grad has no effect on megatron-fsdp >= 0.5; "
                        "use parallelism.report_nan_in_param_grad=true for a NaN check")
    else:
        if ac is False or ac is None:
            mode = "none"
        elif ac is True or ac == "full":
            mode = "full"
        elif ac == "selective":
            mode = "selective"
        else:
            raise ConfigError(f"parallelism.activation_checkpointing={ac!r}: allowed: false, "
                              "true, 'full', 'selective'")
        scope = _check_ac_scope(par.activation_checkpointing_scope)
    check_dtype("parallelism.autocast_dtype", getattr(par, "autocast_dtype", None))
    cap = getattr(par, "bucket_cap_mb", None)
    if strategy == "ddp" and cap is not None and not 0 < cap < math.inf:  # (NaN fails too)
        raise ConfigError(f"parallelism.bucket_cap_mb={cap}: the DDP gradient "
                          "bucket size in MiB must be a finite number > 0, or null (PyTorch's "
                          "default, 25)")
    if strategy == "fsdp2":
        if par.enable_async_tensor_parallel and not par.sequence_parallel:
            log.warning("parallelism.enable_async_tensor_parallel=true requires sequence "
                        "parallelism: setting parallelism.sequence_parallel=true")
            par.sequence_parallel = True
        _positive("parallelism.fsdp2_forward_prefetch_depth", par.fsdp2_forward_prefetch_depth, 0)
        _positive("parallelism.fsdp2_backward_prefetch_depth", par.fsdp2_backward_prefetch_depth, 0)
        if par.multimodal.frozen_sharding not in ("root", "per_layer", "replicate"):
            raise ConfigError(f"parallelism.multimodal.frozen_sharding="
                              f"{par.multimodal.frozen_sharding!r}: allowed: root, per_layer, "
                              "replicate")
        if par.multimodal.vision.unit not in VISION_UNITS:
            raise ConfigError(f"parallelism.multimodal.vision.unit="
                              f"{par.multimodal.vision.unit!r}: allowed: "
                              f"{', '.join(VISION_UNITS)} (each tower block its own FSDP2 unit, "
                              "or the whole tower one unit)")
    if strategy in ("fsdp2", "megatron_fsdp") and par.sequence_parallel and mesh.tp_size == 1:
        log.warning("parallelism.sequence_parallel=true has no effect with mesh.tp_size=1")
    return mode, scope


def _check_ac_scope(scope) -> List[str]:
    if scope == "all":
        return ["all"]
    values = [scope] if isinstance(scope, str) else scope
    if not isinstance(values, list) or not values:
        raise ConfigError(f"parallelism.activation_checkpointing_scope={scope!r}: allowed: 'all' "
                          f"or a non-empty list of {', '.join(AC_SCOPES)}")
    for v in values:
        if v not in AC_SCOPES:
            raise ConfigError(f"parallelism.activation_checkpointing_scope contains {v!r}: "
                              f"allowed: 'all' or a list of {', '.join(AC_SCOPES)}")
    return list(values)


def check_trainer_options(trainer: s.TrainerConfig, pipeline, par) -> None:
    """The trainer's loss, profiling, evaluation and read-ahead options."""
    _positive("trainer.eval_every", trainer.eval_every, 0)
    _positive("trainer.prefetch_steps", trainer.prefetch_steps, 0)
    _positive("trainer.loss_chunk_tokens", trainer.loss_chunk_tokens, 1)
    steps = trainer.profile_steps
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]
                                  <= trainer.max_steps):
        raise ConfigError(f"trainer.profile_steps={list(steps)}: [first, last] step numbers "
                          f"with 1 <= first <= last <= trainer.max_steps={trainer.max_steps}")
    if trainer.loss not in LOSSES:
        raise ConfigError(f"trainer.loss={trainer.loss!r}: allowed: {', '.join(LOSSES)} (auto: "
                          "the LM head fused with the loss where that is exact)")
    if trainer.loss == "fused" and isinstance(par, s.MegatronFSDPConfig):
        raise ConfigError("trainer.loss=fused with parallelism=megatron_fsdp: Megatron-FSDP "
                          "keeps the weights in its own buffers; use trainer.loss=auto or plain "
                          "(auto is plain there)")
    if trainer.loss == "fused" and pipeline is not None and pipeline.loss_fn is not None:
        raise ConfigError(f"trainer.loss=fused with pipeline.loss_fn={pipeline.loss_fn!r}: a "
                          "custom pipeline loss takes the logits; set trainer.loss=auto or "
                          "plain")
    if trainer.eval_batches is not None:
        _positive("trainer.eval_batches", trainer.eval_batches, 1)


def check_optim(o: s.OptimConfig) -> None:
    if o.name != "adamw":
        raise ConfigError(f"optim.name={o.name!r}: allowed: adamw")
    if o.lr <= 0:
        raise ConfigError(f"optim.lr={o.lr}: must be > 0")
    if len(o.betas) != 2:
        raise ConfigError(f"optim.betas={o.betas}: needs exactly two values")
    _positive("optim.warmup_steps", o.warmup_steps, 0)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio}: must be within [0, 1]")
    if o.max_grad_norm is not None and o.max_grad_norm <= 0:
        raise ConfigError(f"optim.max_grad_norm={o.max_grad_norm}: must be > 0 or null")


def model_numbers(model: s.ModelConfig) -> dict:
    """The model's size numbers from model.config, or from config.json of pretrained_path."""
    numbers = dict(model.config)
    if model.pretrained_path is not None:
        path = os.path.join(model.pretrained_path, "config.json")
        if os.path.isfile(path):
            import json

            with open(path, encoding="utf-8") as f:
                numbers = {**json.load(f), **numbers}
    return numbers


def check_tensor_parallel(par, mesh: s.MeshConfig, model: s.ModelConfig,
                          trainer: s.TrainerConfig) -> None:
    plan = getattr(par, "tp_plan", None)
    if plan is not None and not isinstance(plan, (dict, str)):
        raise ConfigError(f"parallelism.tp_plan={plan!r}: expected null, a mapping of FQN "
                          "pattern -> style name, or an import path 'package.module.NAME'")
    if isinstance(plan, str) and ("." not in plan or plan.startswith(".") or plan.endswith(".")):
        raise ConfigError(f"parallelism.tp_plan={plan!r}: an import path looks like "
                          "'package.module.NAME' (a dict, or a function returning one)")
    if isinstance(plan, dict):
        for pattern, style in plan.items():
            problem = style_problem(style)
            if problem is not None:
                raise ConfigError(f"parallelism.tp_plan: pattern {pattern!r} uses style "
                                  f"{style!r}, which {problem}")
    tp = mesh.tp_size
    if tp == 1:
        if getattr(par, "enable_async_tensor_parallel", False):
            log.warning("parallelism.enable_async_tensor_parallel=true has no effect with "
                        "mesh.tp_size=1")
        return
    if getattr(par, "enable_async_tensor_parallel", False) and not getattr(
            par, "enable_compile", False):
        # inductor's micro-pipelined TP rewrites compiled graphs only
        log.warning("parallelism.enable_async_tensor_parallel=true without "
                    "parallelism.enable_compile=true overlaps nothing: inductor overlaps TP "
                    "collectives with compute only in compiled code; set "
                    "parallelism.enable_compile=true (compiles each decoder layer) for the "
                    "overlap, or drop enable_async_tensor_parallel")
    if getattr(par, "enable_compile", False) and not getattr(par, "sequence_parallel", True):
        # Measured on torch 2.13: compiled decoder layers with plain (non-sequence-parallel)
        # TP give wrong gradients; with sequence parallelism they match eager exactly.
        log.warning("parallelism.enable_compile=true with mesh.tp_size=%d: setting "
                    "parallelism.sequence_parallel=true (compiled TP layers need it)", tp)
        par.sequence_parallel = True
    # What the plan needs of the model's sizes (heads, vocabulary) is checked on the model's
    # own structure before launch: automodel.launch.preflight.
    cp = mesh.cp_size
    if getattr(par, "sequence_parallel", False) and (trainer.seq_len // cp) % tp:
        split = f" / mesh.cp_size={cp} = {trainer.seq_len // cp} per cp rank" if cp > 1 else ""
        raise ConfigError(f"trainer.seq_len={trainer.seq_len}{split} must be divisible by "
                          f"mesh.tp_size={tp} with parallelism.sequence_parallel=true")


def check_logger(logger: s.LoggerConfig) -> None:
    if logger.wandb is not None and logger.wandb.mode not in (None, "online", "offline",
                                                              "disabled"):
        raise ConfigError(f"logger.wandb.mode={logger.wandb.mode!r}: allowed: online, offline, "
                          "disabled, or null (W&B's WANDB_MODE, else online)")


def _check_checkpoint_files(key: str, path: str) -> None:
    """A whole checkpoint, no shard missing or truncated (reads its metadata; imports torch)."""
    from automodel.checkpoint.verify import CheckpointError, check_files

    try:
        check_files(path)
    except CheckpointError as err:
        raise ConfigError(f"{key}: {err}") from None


def check_checkpoint(c: s.CheckpointConfig, trainer: s.TrainerConfig, output_dir: str) -> None:
    _positive("checkpoint.every_steps", c.every_steps)
    _positive("checkpoint.keep_last", c.keep_last)
    if c.resume is not None and c.resume != "auto":
        if not os.path.isdir(c.resume):
            raise ConfigError(f"checkpoint.resume={c.resume!r}: no such checkpoint directory; "
                              "use auto (the latest in checkpoint.dir), a path, or null")
        _check_checkpoint_files("checkpoint.resume", c.resume)
    if c.resume == "auto":
        from automodel.checkpoint.paths import checkpoint_root, complete_checkpoints

        found = complete_checkpoints(checkpoint_root(c.dir, output_dir))
        if found:
            _check_checkpoint_files("checkpoint.resume=auto found", found[-1])
    if trainer.on_nonfinite not in ("raise", "skip"):
        raise ConfigError(f"trainer.on_nonfinite={trainer.on_nonfinite!r}: allowed: raise, skip")
    if trainer.stop_at_step is not None and not 1 <= trainer.stop_at_step <= trainer.max_steps:
        raise ConfigError(f"trainer.stop_at_step={trainer.stop_at_step}: must be within "
                          f"1..trainer.max_steps={trainer.max_steps}")
