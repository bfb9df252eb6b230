"""Validation of the ``parallelism`` node (no torch): the checks of each shipped strategy
(``config/strategies.py`` names them in its entries), and the mesh degrees each one runs.

A strategy's ``check(options, layout)`` returns a ``ResolvedParallelism`` and never changes
its input; ``resolve(options, layout)`` returns the options, or a copy with what other options
imply; ``check_layout(name, layout)`` refuses the degrees it cannot run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

from automodel.config.build import ConfigError
from automodel.config.enums import LAYER_GROUPS as AC_SCOPES
from automodel.config.enums import MEGATRON_ZERO_STRATEGIES, ACMode
from automodel.config.layout import Layout
from automodel.config.policies import PolicySpec, resolve_policy
from automodel.config.value_checks import check_dtype, positive

log = logging.getLogger(__name__)

MEGATRON_PLAIN_LOSS = ("Megatron-FSDP keeps the weights in its own buffers; use trainer.loss="
                       "auto or plain (auto is plain there)")


@dataclass(frozen=True)
class ResolvedParallelism:
    """What a strategy's ``check`` returns: its options (a resolved copy) and the values
    derived from them."""

    options: Any  # the strategy's schema instance
    activation_checkpointing: str = "none"  # none | full | selective
    activation_checkpointing_scope: List[str] = field(default_factory=lambda: ["all"])
    mp_policy: Optional[PolicySpec] = None  # FSDP2's policies (null: the default)
    offload_policy: Optional[PolicySpec] = None


def _resolved(options, mode: str, scope: List[str], **policies):
    return ResolvedParallelism(options, mode, list(scope), **policies)


# --------------------------------------------------------------------------- options
def check_pre_shard_hook(par) -> None:
    """``parallelism.pre_shard_hook`` must import and be callable (the import runs here)."""
    path = par.pre_shard_hook
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


def check_common(par, layout: Layout):
    """The options of ``CommonOptions`` (every shipped strategy but Megatron-FSDP's): the
    pre-shard hook, activation checkpointing and its scope, the autocast dtype."""
    check_pre_shard_hook(par)
    mode = ACMode.parse("parallelism.activation_checkpointing", par.activation_checkpointing)
    scope = _check_ac_scope(par.activation_checkpointing_scope)
    check_dtype("parallelism.autocast_dtype", par.autocast_dtype)
    return _resolved(par, mode, scope)


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


def check_ddp(par, layout: Layout):
    resolved = check_common(par, layout)
    cap = par.bucket_cap_mb
    if cap is not None and not 0 < cap < math.inf:  # (NaN fails too)
        raise ConfigError(f"parallelism.bucket_cap_mb={cap}: the DDP gradient "
                          "bucket size in MiB must be a finite number > 0, or null (PyTorch's "
                          "default, 25)")
    return resolved


def check_fsdp2(par, layout: Layout):
    """FSDP2's (and HSDP's) options, and its mixed-precision and offload policies."""
    resolved = check_common(par, layout)
    positive("parallelism.fsdp2_forward_prefetch_depth", par.fsdp2_forward_prefetch_depth, 0)
    positive("parallelism.fsdp2_backward_prefetch_depth", par.fsdp2_backward_prefetch_depth, 0)
    # (multimodal.frozen_sharding and vision.unit are enums: their schema refuses others)
    if str(par.multimodal.vision.tp) == "heads" and layout.tp == 1:
        raise ConfigError("parallelism.multimodal.vision.tp=heads splits the vision tower over "
                          "the TP ranks, but mesh.tp_size=1; set mesh.tp_size > 1, or "
                          "parallelism.multimodal.vision.tp=whole")
    _warn_idle_sequence_parallel(par, layout)
    return dataclasses.replace(
        resolved, mp_policy=resolve_policy("parallelism.mp_policy", par.mp_policy),
        offload_policy=resolve_policy("parallelism.offload_policy", par.offload_policy))


def check_megatron(par, layout: Layout):
    """Megatron-FSDP's options: its activation checkpointing is a bool (the MLPs)."""
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
    check_dtype("parallelism.autocast_dtype", par.autocast_dtype)
    _warn_idle_sequence_parallel(par, layout)
    return _resolved(par, ACMode.full if par.activation_checkpointing else ACMode.none,
                     ["all"])


def _warn_idle_sequence_parallel(par, layout: Layout) -> None:
    if par.sequence_parallel and not layout.tp_enabled:
        log.warning("parallelism.sequence_parallel=true has no effect with mesh.tp_size=1")


def resolve_fsdp2(par, layout: Layout):
    """``par``, or a copy with sequence parallelism on where another option needs it."""
    if par.enable_async_tensor_parallel and not par.sequence_parallel:
        log.warning("parallelism.enable_async_tensor_parallel=true requires sequence "
                    "parallelism: setting parallelism.sequence_parallel=true")
        par = dataclasses.replace(par, sequence_parallel=True)
    if layout.tp_enabled and par.enable_compile and not par.sequence_parallel:
        # Measured on torch 2.13: compiled decoder layers with plain (non-sequence-parallel)
        # TP give wrong gradients; with sequence parallelism they match eager exactly.
        log.warning("parallelism.enable_compile=true with mesh.tp_size=%d: setting "
                    "parallelism.sequence_parallel=true (compiled TP layers need it)", layout.tp)
        par = dataclasses.replace(par, sequence_parallel=True)
    return par


# --------------------------------------------------------------------------- mesh degrees
def refuse_replicate(name: str, layout: Layout) -> None:
    """HSDP's replicate axis, for a strategy that has none."""
    if layout.dp_replicate_enabled:
        raise ConfigError(f"mesh.dp_replicate_size={layout.dp_replicate} is HSDP and needs "
                          f"parallelism=fsdp2 (or hsdp, or megatron_fsdp), not "
                          f"parallelism={name}")


def only_data_parallel(name: str, layout: Layout) -> None:
    """A strategy that only replicates data (DDP): no other mesh axis."""
    refuse_replicate(name, layout)
    for key, value in (("tp_size", layout.tp), ("cp_size", layout.cp),
                       ("pp_size", layout.pp), ("ep_size", layout.ep)):
        if value > 1:
            raise ConfigError(f"mesh.{key}={value}: parallelism={name} only replicates data; "
                              "use parallelism=fsdp2 for tensor/context/pipeline/expert "
                              "parallelism")


def check_fsdp2_layout(name: str, layout: Layout) -> None:
    """FSDP2 composes with every axis."""


def check_megatron_layout(name: str, layout: Layout) -> None:
    for key, value in (("pp_size", layout.pp), ("ep_size", layout.ep)):
        if value > 1:
            raise ConfigError(f"mesh.{key}={value}: parallelism={name} does not "
                              "support pipeline or expert parallelism; use parallelism=fsdp2")
    if layout.tp_enabled:
        raise ConfigError(f"mesh.tp_size={layout.tp}: parallelism={name} is not "
                          "available with tensor parallelism in this version (untested: "
                          "it needs two GPUs or more); set mesh.tp_size=1, or use "
                          "parallelism=fsdp2 for TP (with FSDP2 or HSDP)")
