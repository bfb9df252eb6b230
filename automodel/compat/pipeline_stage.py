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
_PLAN = "plan.py (the pipeline bubble from the schedule's action list)"
_ACTION_FIELDS = ("stage_index", "computation_type", "microbatch_index", "sub_actions")

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
    Internal(_SCHEDULES, "_Action", _PLAN, patched=False, check=lambda t: None if set(
        _ACTION_FIELDS) <= set(getattr(t, "_fields", ())) else
        f"lacks one of the fields {', '.join(_ACTION_FIELDS)}"),
    Internal(_SCHEDULES, "_PipelineScheduleRuntime._prepare_schedule_with_comms", _PLAN,
             patched=False, params=("self", "actions"), check=lambda f: None if
             "pipeline_order_with_comms" in f.__code__.co_names else
             "no longer sets pipeline_order_with_comms (the lowered action list)"),
    Internal(_SCHEDULES, "PipelineScheduleSingle.pipeline_order", _PLAN, patched=False,
             assigned_in=True),
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


def lowered_actions(schedule) -> dict[int, list[tuple]]:
    """rank -> the actions a torch schedule object runs, in order, as ``(kind, stage,
    micro-batch)`` (kind: torch's ``_ComputationType`` value: ``F``, ``B``, ``I``, ``W``,
    ``SEND_F``, ``UNSHARD``, ...; micro-batch None for stage-wide actions). Runtime schedules
    (every multi-stage one, and CSV): ``pipeline_order_with_comms``, the list their
    ``_step_microbatches`` walks, after torch's lowering (send/recv, unshard/reshard, reduce).
    Single-stage ones (GPipe, 1F1B): ``pipeline_order``, torch's IR of the order their
    ``_step_microbatches`` hard-codes. torch's idle placeholders (None) are dropped; an
    ``OVERLAP_F_B`` becomes its sub-actions, which the runtime runs one after the other."""
    order = getattr(schedule, "pipeline_order_with_comms", None) or schedule.pipeline_order
    if not order:
        raise ValueError(f"{type(schedule).__name__} has no action list (pipeline_order)")
    out = {}
    for rank, actions in order.items():
        flat = []
        for a in actions:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                flat.append((sub.computation_type.value, sub.stage_index, sub.microbatch_index))
        out[rank] = flat
    return out
