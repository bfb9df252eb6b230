"""Internals of ``torch.nn`` modules, activation checkpointing and foreach kernels that automodel
patches or reads."""

from __future__ import annotations

import contextlib

from automodel.compat.core import Internal


def _linear():
    from torch import nn

    return nn.Linear(1, 1)


def _reads_parameter_table(table) -> str | None:
    """A module's attribute lookup still answers from its ``_parameters`` table."""
    import torch

    module, stand_in = _linear(), torch.zeros(1, 1)
    module._parameters["weight"] = stand_in
    return None if module.weight is stand_in else "attribute lookup no longer reads it"


_TABLE = ("frozen_sharding / compute_in_param_dtype, expert parallelism, local_params TP "
          "entries, meta-device builds (parameters swapped in place for a forward)")

INTERNALS = [
    Internal("torch.nn.Module()", "_parameters", _TABLE, probe=_linear, kind=dict,
             check=_reads_parameter_table),
    Internal("torch.nn.Module()", "_buffers", "megatron_fsdp meta-device initialization "
             "(buffers moved to the device in place)", probe=_linear, kind=dict),
    Internal("torch.nn.Module()", "_modules", "pipeline stages (a stage's layers looked "
             "up by index)", probe=_linear, patched=False, kind=dict),
    Internal("torch.nn", "Module.register_parameter", "meta-device model builds (every "
             "parameter moved to meta as it is registered)", params=("self", "name", "param")),
    Internal("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper",
             "activation_checkpointing", patched=False, params=("module", "checkpoint_impl")),
    Internal("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl",
             "activation_checkpointing", patched=False, kind=type),
    Internal("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper",
             "frozen_sharding (finding checkpoint-wrapped blocks)", patched=False, kind=type),
    Internal("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "_CHECKPOINT_PREFIX",
             "parameter names under activation checkpointing (loading weights, megatron_fsdp "
             "meta-device initialization)", patched=False, kind=str),
    Internal("torch", "_foreach_norm", "gradient norms and clipping (trainer.max_grad_norm)",
             patched=False, params=()),
    Internal("torch", "_foreach_mul_", "gradient clipping (trainer.max_grad_norm)",
             patched=False, params=()),
]


def get_parameter(module, name: str):
    """The module's own entry ``name`` (no lookup in children; None where registered so)."""
    return module._parameters[name]


def set_parameter(module, name: str, value) -> None:
    """Put ``value`` (a Parameter, or a plain tensor standing in during one forward) into the
    module's parameter table without ``register_parameter``'s checks."""
    module._parameters[name] = value


def direct_parameters(module) -> list:
    """(name, value) of the module's own parameter table, None entries included."""
    return list(module._parameters.items())


def replace_parameter_table(module, table: dict) -> None:
    """Give ``module`` a parameter table of its own (a shallow copy of a module would share
    the original's)."""
    module._parameters = table


def child_module(module, name: str):
    """The module's own child ``name``, read from its table (no ``__getattr__`` override)."""
    return module._modules[name]


def direct_buffers(module) -> list:
    return list(module._buffers.items())


def set_buffer(module, name: str, value) -> None:
    module._buffers[name] = value


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered meanwhile moves to the meta device as it is registered
    (allocated empty, never initialized); buffers stay real. Under the planner's fake-tensor
    mode too the parameters are plain meta tensors: a model that converts a module while it
    builds it (``.to(torch.float32)``) could not swap fake ones in place."""
    import torch
    from torch import nn

    from automodel.compat.planning import real_tensors

    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            with real_tensors():
                meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
            module._parameters[name] = nn.Parameter(meta, requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_wrapper_api():
    """torch's (private) activation-checkpoint wrapper module: ``checkpoint_wrapper``,
    ``CheckpointImpl``, ``ActivationWrapper``."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper

    return checkpoint_wrapper


def unwrapped_name(name: str) -> str:
    """A parameter name as the model has it without activation-checkpoint wrappers."""
    return name.replace(checkpoint_wrapper_api()._CHECKPOINT_PREFIX, "")


def foreach_norm(tensors, ord: float):
    import torch

    return torch._foreach_norm(tensors, ord)


def foreach_mul_(tensors, scalar) -> None:
    import torch

    torch._foreach_mul_(tensors, scalar)
