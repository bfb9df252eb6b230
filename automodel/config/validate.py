"""Validation rules that need only numbers and names (no torch, no processes): the run's own
sections (distributed, trainer, optim, checkpoint) and tensor parallelism.

The other topics have their own modules: validate_layout (mesh sizes), validate_parallelism
(each strategy's options), validate_model, validate_data, validate_pipeline. Each function
checks one section (or a pair of sections that constrain each other) and raises
``ConfigError`` naming the key, the value and what is allowed. ``resolve.py`` calls them.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.config.enums import AsyncMode
from automodel.config.layout import Layout
from automodel.config.tp_styles import style_problem
from automodel.config.value_checks import above_zero, positive, shard_bytes

log = logging.getLogger(__name__)

def check_distributed(d: s.DistributedConfig) -> None:
    if d.backend is not None and d.backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise ConfigError(f"distributed.backend={d.backend!r}: allowed: gloo, nccl, mpi, ucc, "
                          "xccl, or null (nccl with CUDA, else gloo)")
    above_zero("distributed.timeout_minutes", d.timeout_minutes)
    above_zero("distributed.startup_timeout_minutes", d.startup_timeout_minutes)
    positive("distributed.nproc_per_node", d.nproc_per_node)
    positive("distributed.stop_grace_seconds", d.stop_grace_seconds, 0)
    positive("distributed.max_restarts", d.max_restarts, 0)


def check_trainer_options(trainer: s.TrainerConfig, pipeline, strategy) -> None:
    """The trainer's loss, profiling, evaluation, stop and read-ahead options (``strategy``: the
    ``Strategy`` entry of ``config/strategies.py``)."""
    positive("trainer.eval_every", trainer.eval_every, 0)
    positive("trainer.prefetch_steps", trainer.prefetch_steps, 0)
    positive("trainer.loss_chunk_tokens", trainer.loss_chunk_tokens, 1)
    steps = trainer.profile_steps
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]
                                  <= trainer.max_steps):
        raise ConfigError(f"trainer.profile_steps={list(steps)}: [first, last] step numbers "
                          f"with 1 <= first <= last <= trainer.max_steps={trainer.max_steps}")
    if trainer.loss == "fused" and strategy.plain_loss_reason is not None:
        raise ConfigError(f"trainer.loss=fused with parallelism={strategy.name}: "
                          f"{strategy.plain_loss_reason}")
    if trainer.loss == "fused" and pipeline is not None and pipeline.loss_fn is not None:
        raise ConfigError(f"trainer.loss=fused with pipeline.loss_fn={pipeline.loss_fn!r}: a "
                          "custom pipeline loss takes the logits; set trainer.loss=auto or "
                          "plain")
    if trainer.eval_batches is not None:
        positive("trainer.eval_batches", trainer.eval_batches, 1)
    n = trainer.plan_check_steps
    if n is not None and n != 0 and not 3 <= n <= trainer.max_steps:
        raise ConfigError(f"trainer.plan_check_steps={n}: 0 (off) or 3..trainer.max_steps="
                          f"{trainer.max_steps} (the first step warms up, the second counts "
                          "the bytes per axis, the others are timed)")
    if trainer.stop_at_step is not None and not 1 <= trainer.stop_at_step <= trainer.max_steps:
        raise ConfigError(f"trainer.stop_at_step={trainer.stop_at_step}: must be within "
                          f"1..trainer.max_steps={trainer.max_steps}")


def check_tensor_memory(trainer: s.TrainerConfig, par) -> None:
    """The CPU count of live tensors is a dispatch mode, under which torch.compile compiles
    nothing."""
    if trainer.track_tensor_memory and getattr(par, "enable_compile", False):
        raise ConfigError("trainer.track_tensor_memory=true with parallelism.enable_compile="
                          "true: the CPU count of live tensors (a dispatch mode) would stop "
                          "torch.compile from compiling; set trainer.track_tensor_memory=null "
                          "(a GPU still counts them, with its allocator) or turn compile off")


def check_optim(o: s.OptimConfig) -> None:
    if o.name != "adamw":
        raise ConfigError(f"optim.name={o.name!r}: allowed: adamw")
    if o.lr <= 0:
        raise ConfigError(f"optim.lr={o.lr}: must be > 0")
    if len(o.betas) != 2:
        raise ConfigError(f"optim.betas={o.betas}: needs exactly two values")
    positive("optim.warmup_steps", o.warmup_steps, 0)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio}: must be within [0, 1]")
    if o.max_grad_norm is not None and o.max_grad_norm <= 0:
        raise ConfigError(f"optim.max_grad_norm={o.max_grad_norm}: must be > 0 or null")



def resolve_sequence_parallel(strategy, par, layout: Layout):
    """``par``, or a copy with sequence parallelism on where another option needs it (the
    strategy's own rule: ``config/validate_parallelism.py``); ``strategy``: a name or entry."""
    from automodel.config.strategies import strategy as strategy_of

    return strategy_of(strategy).resolved(par, layout)


def check_tensor_parallel(par, layout: Layout, model: s.ModelConfig,
                          trainer: s.TrainerConfig) -> None:
    """For a strategy with ``tensor_parallel`` (config/strategies.py): its options carry
    ``tp_plan`` and ``sequence_parallel``."""
    plan = par.tp_plan
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
    if not layout.tp_enabled:
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
    # What the plan needs of the model's sizes (heads, vocabulary) is checked on the model's
    # own structure before launch: automodel.checks.preflight.
    if par.sequence_parallel:
        layout.check_sequence_parallel_seq_len(trainer.seq_len)


EXPORT_HF = {"never": "never", "final": "final", "every": "every", "true": "every",
             "false": "never"}
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
LOAD_PARTS = ("optimizer", "scheduler", "step", "rng")  # what exclude_from_loading may name


def check_checkpoint(c: s.CheckpointConfig) -> s.CheckpointConfig:
    """The values (a copy, ``export_hf`` as never / final / every); whether the checkpoint to
    resume or start from is whole needs its metadata (torch), and is checked before launch
    (``checks/preflight.py``: check_resume_checkpoint)."""
    export = EXPORT_HF.get(str(c.export_hf).lower())
    if export is None:
        raise ConfigError(f"checkpoint.export_hf={c.export_hf!r}: use never, final (the "
                          "checkpoint of trainer.max_steps) or every")
    if c.export_dtype is not None and c.export_dtype not in EXPORT_DTYPES:
        raise ConfigError(f"checkpoint.export_dtype={c.export_dtype!r}: use one of "
                          f"{', '.join(EXPORT_DTYPES)}, or null (as trained)")
    above_zero("checkpoint.save_timeout_minutes", c.save_timeout_minutes)
    try:
        shard_bytes(c.export_max_shard_size)
    except ValueError as err:
        raise ConfigError(f"checkpoint.export_max_shard_size: {err}") from None
    unknown = [k for k in c.exclude_from_loading if k not in LOAD_PARTS]
    if unknown:
        hint = (" (a checkpoint's weights are always loaded: to start without them, leave "
                "checkpoint.resume and checkpoint.initial_load_path null)"
                if "model" in unknown else "")
        raise ConfigError(f"checkpoint.exclude_from_loading={list(c.exclude_from_loading)}: "
                          f"{', '.join(map(repr, unknown))} names nothing a load reads; name "
                          f"any of {', '.join(LOAD_PARTS)}{hint}")
    if c.initial_load_path is not None and not os.path.isdir(c.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path={c.initial_load_path!r}: no such "
                          "checkpoint directory (a step_<N> folder of checkpoint.dir)")
    _check_values(c)
    return dataclasses.replace(c, export_hf=export)


def _check_values(c: s.CheckpointConfig) -> None:
    positive("checkpoint.every_steps", c.every_steps)
    positive("checkpoint.keep_last", c.keep_last)
    if c.resume is not None and c.resume != "auto" and not os.path.isdir(c.resume):
        raise ConfigError(f"checkpoint.resume={c.resume!r}: no such checkpoint directory; "
                          "use auto (the latest in checkpoint.dir), a path, or null")
    if c.async_mode != AsyncMode.none and c.every_steps is None:
        raise ConfigError(f"checkpoint.async_mode={c.async_mode.value} saves in the background, "
                          "but checkpoint.every_steps is null: no save is due during training "
                          "(a run's last save always blocks); set checkpoint.every_steps=N or "
                          "checkpoint.async_mode=none")
    if c.pinned_memory and c.async_mode == AsyncMode.none:
        raise ConfigError("checkpoint.pinned_memory=true is the host memory of async saves, "
                          "but checkpoint.async_mode=none; set checkpoint.async_mode=thread "
                          "(or process), or drop checkpoint.pinned_memory")
