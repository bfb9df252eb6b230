"""torch internals the planner (``automodel/planning``) uses to run automodel's own code for any
world size in one CPU process: the fake process group, torch's memory trackers, and the table of
which argument of each collective op holds its process group."""

from __future__ import annotations

import contextlib

from automodel.compat import planning_memory
from automodel.compat.core import Internal
from automodel.compat.planning_memory import (  # noqa: F401 (the planner's names, here)
    host_memory_device,
    in_sharding_propagation,
    memory_tracker,
    offloaded_parameters,
    optimizer_peak_bytes,
    peak_snapshots,
    sharding_propagation_marked,
)

_TOOLS = "torch.distributed._tools"
_FEATURE = "plan.py (planning a layout without the hardware)"

INTERNALS = [
    Internal("torch.testing._internal.distributed.fake_pg", "FakeStore", _FEATURE,
             patched=False, params=()),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker", _FEATURE, patched=False, params=()),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker.get_tracker_snapshot", _FEATURE,
             patched=False, params=("self", "type")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._pre_fw_hook", _FEATURE,
             params=("self", "module", "inputs")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._post_fw_hook", _FEATURE,
             params=("self", "module", "inputs", "outputs")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._pre_bw_hook", _FEATURE,
             params=("self", "module", "args")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._post_bw_hook", _FEATURE,
             params=("self", "module", "args")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._track_inputs_or_outputs", _FEATURE,
             params=("self", "args")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._ac_mod", _FEATURE, assigned_in=True),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._in_ac", _FEATURE, assigned_in=True),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._in_opt", _FEATURE, patched=False,
             assigned_in=True),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._update_peak_stats", _FEATURE,
             params=("self", "peak_state")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._track_module_params_and_buffers",
             _FEATURE, params=("self", "module", "install_grad_hooks")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._param_to_grad_hook_handles", _FEATURE,
             assigned_in=True),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._curr_mem_snap", _FEATURE, patched=False,
             assigned_in=True),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._peak_mem_snap", _FEATURE, patched=False,
             assigned_in=True),
    Internal(f"{_TOOLS}.fake_collectives", "CollectiveOp.get_process_group", _FEATURE,
             patched=False, params=("func", "args")),
    Internal(f"{_TOOLS}.fake_collectives", "collective_ops", _FEATURE, patched=False,
             kind=set),
]


def fake_store():
    """A store for ``init_process_group("fake", ...)``: no other process takes part."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def collective_ops() -> set:
    from torch.distributed._tools.fake_collectives import collective_ops as ops

    return ops


def collective_group(func, args):
    """The process group a c10d or functional collective runs on."""
    from torch.distributed._tools.fake_collectives import CollectiveOp

    return CollectiveOp.get_process_group(func, args)


_SCHEDULES = "torch.distributed.pipelining.schedules"
INTERNALS += [
    Internal("torch.distributed.tensor._sharding_prop",
             "ShardingPropagator._propagate_tensor_meta_non_cached", _FEATURE,
             params=("self", "op_schema")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker.__torch_dispatch__", _FEATURE,
             params=("self", "func", "types", "args", "kwargs")),
]
INTERNALS += [
    Internal(_SCHEDULES, "_PipelineSchedule._warmup_p2p", _FEATURE,
             params=("self", "stages", "has_backward", "p2p_done")),
    Internal("torch.distributed.pipelining._utils", "InferenceMode.needs_dynamic", _FEATURE,
             patched=False, params=("meta", "stage_has_backward")),
    Internal("torch.distributed.pipelining.stage", "PipelineStage._user_meta", _FEATURE,
             patched=False, assigned_in=True),
]


_GROUPED_MM = "grouped matrix products (MoE experts) in float32 on fake tensors"
INTERNALS += [
    Internal("torch._meta_registrations", "_meta_grouped_mm_common", _GROUPED_MM,
             params=("mat_a", "mat_b", "scale_a", "scale_b", "offs", "bias", "scale_result",
                     "out_dtype")),
    Internal("torch._meta_registrations", "_create_grouped_mm_output_tensor", _GROUPED_MM,
             patched=False, params=("mat1", "mat2", "offs", "out_dtype")),
]


INTERNALS += [
    Internal("torch._subclasses.fake_tensor", name, "the preflight's fake step (what fake "
             "tensors cannot compute: values, and shapes that depend on values)",
             patched=False, kind=type)
    for name in ("DataDependentOutputException", "DynamicOutputShapeException")]


def needs_values(err: BaseException) -> bool:
    """Whether ``err`` is the fake mode's own: an op that needs a tensor's values (``.item()``
    on a router's counts) or a shape that depends on them, which fake tensors have not."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    return isinstance(err, (DataDependentOutputException, DynamicOutputShapeException))


@contextlib.contextmanager
def grouped_mm_in_any_float():
    """``torch._grouped_mm``'s shape function checks what the CUDA kernel takes (bfloat16
    only), while the CPU kernel also takes float32 and float16 (transformers' experts of an
    fp32 model on the host run it): inside, an unscaled product of two such inputs of one
    dtype gets its output's shape and dtype without that check."""
    import torch
    import torch._meta_registrations as meta

    original = meta._meta_grouped_mm_common

    def common(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
               out_dtype=None, use_fast_accum=False):
        if (scale_a is None and scale_b is None and bias is None
                and mat_a.dtype == mat_b.dtype and mat_a.dtype in (torch.float32,
                                                                   torch.float16)):
            return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs,
                                                         out_dtype or mat_a.dtype)
        return original(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype,
                        use_fast_accum)

    meta._meta_grouped_mm_common = common
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = original


@contextlib.contextmanager
def pipeline_warmup_without_peers():
    """The schedule's first step votes with its peers over point-to-point messages on how the
    stages learn their shapes. A simulated rank has no peers (a fake group delivers nothing),
    so each of its stages takes its own vote, as every stage of a job with one configuration
    would."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    original = schedules._PipelineSchedule._warmup_p2p

    def local_vote(self, stages, has_backward, p2p_done):
        for stage in stages:
            dynamic = InferenceMode.needs_dynamic(stage._user_meta, has_backward)
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = local_vote
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original


_HELD_SENDS = "plan.py with a pipeline (sent tensors held until their sends are waited)"
INTERNALS += [
    Internal(_SCHEDULES, "_batch_p2p", _HELD_SENDS, params=("p2p_ops", "desc")),
    Internal(_SCHEDULES, "_wait_batch_p2p", _HELD_SENDS, params=("work",)),
]


@contextlib.contextmanager
def sends_held_until_waited():
    """A real process group's send keeps its tensor alive until the send's work is waited
    (gloo's work holds it; NCCL's stashes it for the allocator), and torch's runtime
    schedules (interleaved 1F1B, zero bubble, ...) wait their sends only when the step ends:
    every activation and input gradient a rank sends stays live until then. A fake group's
    work holds nothing. In the simulation each work of the schedule's batched point-to-point
    calls holds the tensors it carries until ``_wait_batch_p2p`` is called with it, as a real
    group's does (1F1B's own loop waits each send at once: nothing changes there)."""
    from torch.distributed.pipelining import schedules

    batch, wait = schedules._batch_p2p, schedules._wait_batch_p2p
    held: dict[int, list] = {}

    def batch_held(p2p_ops, desc=None):
        works = batch(p2p_ops, desc=desc)
        for w in works:
            held[id(w)] = [w, [p.tensor for p in p2p_ops]]
        return works

    def wait_released(work):
        wait(work)
        for w in work:
            held.pop(id(w), None)

    schedules._batch_p2p, schedules._wait_batch_p2p = batch_held, wait_released
    try:
        yield
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = batch, wait
        held.clear()


_SPLIT_BACKWARD = "plan.py with pipeline=zero_bubble or v_schedule (a split backward)"
INTERNALS += [
    Internal(f"{_TOOLS}.mod_tracker", "register_multi_grad_hook", _SPLIT_BACKWARD,
             params=("tensors", "fn")),
]


@contextlib.contextmanager
def split_backward_tracked():
    """The memory tracker's module tracker hooks each module's inputs to learn when its
    backward ends (``register_multi_grad_hook`` in mode ``all``, which asks the engine which of
    them it will reach). A pipeline stage's input is a leaf, and under a split backward
    (zero-bubble schedules: ``autograd.grad`` for the input gradient) the engine refuses that
    question for a leaf. Where an input is a leaf, the hook is registered in mode ``any``: it
    runs at the first of the inputs' gradients instead of the last, which moves only the
    per-module statistics the planner does not read (live bytes and their kinds follow the
    engine, not the module stack)."""
    from torch.distributed._tools import mod_tracker

    original = mod_tracker.register_multi_grad_hook

    def register(tensors, fn, *, mode="all"):
        if mode == "all" and any(t.grad_fn is None for t in tensors):
            mode = "any"
        return original(tensors, fn, mode=mode)

    mod_tracker.register_multi_grad_hook = register
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original


_DDP_FEATURE = "plan.py with parallelism=ddp (DDP's gradient buckets, re-enacted)"
INTERNALS += [
    Internal("torch.distributed", "_compute_bucket_assignment_by_size", _DDP_FEATURE,
             patched=False, params=()),
    Internal("torch.distributed", "_DEFAULT_FIRST_BUCKET_BYTES", _DDP_FEATURE, patched=False,
             kind=int),
    Internal("torch.nn.parallel.distributed", "_DEFAULT_BUCKET_CAP_MB", _DDP_FEATURE,
             patched=False, kind=int),
    Internal("torch.nn.parallel.distributed", "_MB_TO_BYTES", _DDP_FEATURE, patched=False,
             kind=int),
]


def ddp_bucket_caps(bucket_cap_mb) -> tuple[int, int]:
    """(first bucket's limit, other buckets' limit) in bytes, as DDP derives them from its
    ``bucket_cap_mb`` (None: 25 MiB, and a first bucket of 1 MiB)."""
    import torch.distributed as dist
    from torch.nn.parallel import distributed as ddp

    cap = int((ddp._DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb)
              * ddp._MB_TO_BYTES)
    return (dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap), cap


def ddp_bucket_assignment(tensors: list, limits: list, indices: list | None = None) -> list:
    """torch's assignment of ``tensors`` (or of gradients shaped like them) to buckets of at
    most ``limits`` bytes (the first bucket of a dtype ``limits[0]``, then the next limit):
    lists of indices (``indices[i]`` names ``tensors[i]`` when given). Read from meta tensors
    of the same shapes: the assignment looks at sizes, dtypes and devices only."""
    import torch
    import torch.distributed as dist

    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors]
    buckets, _ = dist._compute_bucket_assignment_by_size(meta, limits, [False] * len(meta),
                                                        list(indices or []))
    return [list(b) for b in buckets]


INTERNALS += [
    Internal("torch", "_check_tensor_all_with", _FEATURE,
             params=("error_type", "cond", "message")),
]


@contextlib.contextmanager
def value_checks_pass_on_fake_tensors():
    """A model's check of tensor values (transformers' ``torch_compilable_check``, e.g. an
    image-text model's "as many image tokens as image features") passes when the values
    are fake, which have none; the planner's batches have the configured shapes. A check on
    real tensors runs as before."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch._check_tensor_all_with

    def check(error_type, cond, message=None):
        if isinstance(cond, FakeTensor):
            return None
        return original(error_type, cond, message)

    torch._check_tensor_all_with = check
    try:
        yield
    finally:
        torch._check_tensor_all_with = original


def fake_tensor_mode():
    """torch's fake-tensor mode: tensors carry shape, dtype and device, and no storage; real
    host tensors passed in are taken as fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def real_tensors():
    """A context in which operators run for real under a fake-tensor mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def op_name(func) -> str:
    """The name of an operator overload without its overload (``allreduce_``)."""
    return func._overloadpacket.__name__


def op_packet(func):
    return func._overloadpacket


INTERNALS += planning_memory.INTERNALS
