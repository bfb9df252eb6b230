"""torch internals the planner (``automodel/planning``) uses to run automodel's own code for any
world size in one CPU process: the fake process group, torch's memory trackers, and the table of
which argument of each collective op holds its process group."""

from __future__ import annotations

import contextlib
import threading

from automodel.compat.core import Internal

_TOOLS = "torch.distributed._tools"
_FEATURE = "plan.py (planning a layout without the hardware)"

INTERNALS = [
    Internal("torch.testing._internal.distributed.fake_pg", "FakeStore", _FEATURE,
             patched=False, params=()),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker", _FEATURE, patched=False, params=()),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker.get_tracker_snapshot", _FEATURE,
             patched=False, params=("self", "type")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker.reset_mod_stats", _FEATURE, patched=False,
             params=("self",)),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._pre_fw_hook", _FEATURE,
             params=("self", "module", "inputs")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker.memory_tracking", _FEATURE, patched=False,
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


def memory_tracker(roots: list, optimizers: list):
    """torch's tracker of live tensor memory by kind (parameters, gradients, optimizer
    states, activations, temporaries), which knows ``roots``' parameters and the optimizers'
    states, and accepts a module run several times per step (gradient accumulation, pipeline
    micro-batches; torch's own refuses: its per-module statistics, which the planner does not
    use, would mix the runs)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if in_sharding_propagation():  # (no tensor of the rank: see below)
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]  # (a new run of it: fresh module stats)
            return super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # torch's registers a gradient hook on every parameter, which a frozen one
            # (``model.freeze``) refuses: a frozen parameter gets no gradient, so it is
            # entered as hooked already (with handles that remove nothing)
            for p in module.parameters():
                if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state):
            # the whole rank's peak only: torch's also walks every module's statistics on
            # every operator (most of a large model's planning time), which are not used
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    tracker = StepMemTracker()
    tracker.track_external(*roots, *optimizers)
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass


_PROPAGATION = threading.local()


def in_sharding_propagation() -> bool:
    """Whether DTensor is now working out an operator's output shape: it runs the operator on
    fake tensors of the global shapes, in the active fake mode (the planner's), so the
    planner's counters must not take those for the rank's own tensors, FLOPs or traffic (in a
    real run they live in a fake mode of DTensor's own and cost nothing)."""
    return getattr(_PROPAGATION, "depth", 0) > 0


@contextlib.contextmanager
def sharding_propagation_marked():
    """Inside, ``in_sharding_propagation()`` tells DTensor's shape propagation apart."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def marked(self, *args, **kwargs):
        _PROPAGATION.depth = getattr(_PROPAGATION, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _PROPAGATION.depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = marked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def peak_snapshot(tracker) -> dict:
    """{category name: bytes} at the tracker's peak, summed over devices ("Total": all)."""
    out: dict = {}
    for per_kind in tracker.get_tracker_snapshot("peak").values():
        for kind, n in per_kind.items():
            name = kind if isinstance(kind, str) else kind.value
            out[name] = out.get(name, 0) + n
    return out


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
