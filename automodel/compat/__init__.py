"""Every patch of a torch or transformers internal, and every private object of theirs that
automodel reads, in one place.

Each is an ``Internal`` entry (the feature that needs it, the library object it touches, the
shape expected), next to the function that patches or reads it; the rest of automodel calls
those functions and touches no private name of either library itself (tests/test_compat.py
keeps it so). ``check_compat()`` runs before any process starts (``check_runtime_support``)
and names every entry that the installed versions lack or changed, with the feature, the
pinned and tested versions, and the fix.
"""

from __future__ import annotations

import sys

from automodel.compat import (
    hf,
    pipeline_stage,
    planning,
    torch_dist,
    torch_memory,
    torch_nn,
    torchao_nf4,
    verified,
)
from automodel.compat.core import PINNED, TESTED_WITH, CompatError, Internal, check_entries
from automodel.compat.hf import (
    can_set_attn_implementation,
    causal_lm_class,
    has_causal_lm,
    input_embeddings,
    is_packed_sequence_patched,
    keep_output_recording,
    packed_sequence_finder,
    patch_is_packed_sequence,
    saved_layout,
)
from automodel.compat.pipeline_stage import (
    computation_types,
    csv_schedule,
    defer_reduce_grad,
    stages_of,
    wrap_recv_methods,
)
from automodel.compat.torch_dist import (
    building_mesh_outside_this_rank,
    enable_micro_pipeline_tp,
    enable_symmetric_memory,
    flatten_mesh,
    flatten_state_dict,
    local_shape_and_offset,
    local_tensor,
    new_gloo_options,
    set_all_group_timeouts,
    set_options_timeout,
    stop_checkpoint_writer,
)
from automodel.compat.torch_memory import (
    FLIGHT_RECORDER_ENV,
    dispatch_mode_base,
    flight_recorder_entries,
    is_tensor_subclass,
    is_tensor_subclass_type,
    map_tensors,
    tensor_leaves,
    watch_storage_resizes,
)
from automodel.compat.torch_nn import (
    checkpoint_wrapper_api,
    child_module,
    direct_buffers,
    direct_parameters,
    foreach_mul_,
    foreach_norm,
    get_parameter,
    parameters_on_meta,
    replace_parameter_table,
    set_buffer,
    set_parameter,
    unwrapped_name,
)

INTERNALS: list[Internal] = [*hf.INTERNALS, *torch_dist.INTERNALS, *pipeline_stage.INTERNALS,
                             *torch_nn.INTERNALS, *torch_memory.INTERNALS]


# what plan.py needs besides: checked when a plan starts, not by every training job
PLANNING_INTERNALS: list[Internal] = list(planning.INTERNALS)


# what peft=qlora needs of torchao: checked by the preflight of a QLoRA job only
QLORA_INTERNALS: list[Internal] = list(torchao_nf4.INTERNALS)


def check_planning_compat() -> None:
    """``check_compat`` for the planner's own internals (``compat/planning.py``)."""
    check_entries(PLANNING_INTERNALS)


def check_compat() -> None:
    """Raise ``CompatError`` (a ``ConfigError``) naming each internal that the installed torch
    or transformers lacks or changed (a few milliseconds once the libraries are imported).
    Where this installation passed before (``compat/verified.py``), only the entries of
    modules this process has imported are checked: the others are not imported for it."""
    unloaded = {e.module for e in INTERNALS if e.probe is None} - set(sys.modules)
    key = verified.installation_key("training") if unloaded else None
    if verified.passed_before(key):
        check_entries([e for e in INTERNALS if (e.module if e.probe is None else "torch")
                       in sys.modules])
        return
    check_entries(INTERNALS)
    verified.remember_pass(key)


__all__ = [
    "CompatError", "INTERNALS", "Internal", "PINNED", "PLANNING_INTERNALS", "QLORA_INTERNALS",
    "TESTED_WITH",
    "check_planning_compat",
    "building_mesh_outside_this_rank", "can_set_attn_implementation", "causal_lm_class",
    "check_compat", "check_entries", "checkpoint_wrapper_api", "child_module",
    "computation_types", "csv_schedule", "defer_reduce_grad", "enable_symmetric_memory",
    "flatten_mesh", "has_causal_lm", "input_embeddings", "stop_checkpoint_writer",
    "direct_buffers", "direct_parameters", "enable_micro_pipeline_tp", "flatten_state_dict",
    "foreach_mul_", "foreach_norm", "get_parameter", "is_packed_sequence_patched",
    "keep_output_recording", "local_shape_and_offset", "local_tensor", "new_gloo_options",
    "packed_sequence_finder", "parameters_on_meta", "patch_is_packed_sequence",
    "replace_parameter_table", "saved_layout", "set_all_group_timeouts", "set_buffer",
    "set_options_timeout",
    "set_parameter", "stages_of", "unwrapped_name", "wrap_recv_methods",
    "FLIGHT_RECORDER_ENV", "flight_recorder_entries", "dispatch_mode_base",
    "is_tensor_subclass", "is_tensor_subclass_type", "map_tensors", "tensor_leaves",
    "watch_storage_resizes",
]
