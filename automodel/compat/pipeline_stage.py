"""Private methods of torch's ``PipelineStage`` that automodel wraps on single instances."""

from __future__ import annotations

import functools
from typing import Callable

from automodel.compat.core import Internal

_STAGE = "torch.distributed.pipelining.stage"
_SCHEDULES = "torch.distributed.pipelining.schedules"
_POOL = "pipeline.pp_recv_buffer_pool (receive buffers shared across micro-batches)"
# the four receive methods, by the keyword ``wrap_recv_methods`` takes for each
_RECV = {"forward_setup": "_setup_forward_recv_info",
         "backward_setup": "_setup_backward_recv_info",
         "activations": "_retrieve_recv_activations",
         "grads": "_retrieve_recv_grads"}

_ACTIONS = ("RECV_F", "RECV_B", "FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT")

INTERNALS = [
    Internal(_STAGE, "PipelineStage._setup_forward_recv_info", _POOL,
             params=("self", "num_microbatches", "has_backward")),
    Internal(_STAGE, "PipelineStage._setup_backward_recv_info", _POOL,
             params=("self", "num_microbatches")),
    Internal(_STAGE, "PipelineStage._retrieve_recv_activations", _POOL,
             params=("self", "fwd_chunk_id")),
    Internal(_STAGE, "PipelineStage._retrieve_recv_grads", _POOL,
             params=("self", "bwd_chunk_id")),
    Internal(_STAGE, "PipelineStage.perform_reduce_grad",
             "pipeline.patch_stage_backward_maybe_with_nosync (FSDP reduction deferred to the "
             "last schedule step)", params=("self", "grad_scale_factor")),
    Internal(_SCHEDULES, "PipelineScheduleSingle._stage", "pipeline parallelism (the stages "
             "of a schedule)", patched=False, assigned_in=True),
    Internal(_SCHEDULES, "PipelineScheduleMulti._stages", "pipeline parallelism (the stages "
             "of a schedule)", patched=False, assigned_in=True),
    Internal(_SCHEDULES, "_ComputationType", _POOL + ": the receive actions of interleaved 1F1B",
             patched=False, check=lambda t: None if all(
                 hasattr(t, n) for n in _ACTIONS) else f"lacks one of {', '.join(_ACTIONS)}"),
    Internal(_SCHEDULES, "_PipelineScheduleRuntime", "pipeline.pp_schedule_csv",
             patched=False, kind=type),
    Internal(_SCHEDULES, "_PipelineScheduleRuntime._load_csv", "pipeline.pp_schedule_csv",
             patched=False, params=("self", "filename", "format")),
]


def wrap_recv_methods(stage, *, forward_setup: Callable, backward_setup: Callable,
                      activations: Callable, grads: Callable) -> None:
    """Wrap the receive methods of one ``PipelineStage`` instance. Each wrapper is called with
    the original bound method, then the method's own arguments:
    ``forward_setup(original, num_microbatches, has_backward)``,
    ``backward_setup(original, num_microbatches)``, ``activations(original, fwd_chunk_id)``,
    ``grads(original, bwd_chunk_id)``."""
    given = {"forward_setup": forward_setup, "backward_setup": backward_setup,
             "activations": activations, "grads": grads}
    for key, attr in _RECV.items():
        setattr(stage, attr, functools.partial(given[key], getattr(stage, attr)))


def defer_reduce_grad(stage, deferred: Callable[[], bool]) -> None:
    """One ``PipelineStage`` instance skips its gradient reduction while ``deferred()``."""
    reduce = stage.perform_reduce_grad

    def maybe_reduce(grad_scale_factor):
        if not deferred():
            reduce(grad_scale_factor)

    stage.perform_reduce_grad = maybe_reduce


def stages_of(schedule) -> list:
    """The ``PipelineStage`` objects a torch schedule runs (one or several)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def computation_types():
    """torch's enum of schedule actions (``RECV_F``, ``FORWARD``, ...)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    return _ComputationType


def csv_schedule(stages, csv_path: str, csv_format: str, **kwargs):
    """torch's schedule runtime, its actions loaded from ``csv_path``."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    schedule = _PipelineScheduleRuntime(stages, **kwargs)
    schedule._load_csv(csv_path, format=csv_format)
    return schedule
