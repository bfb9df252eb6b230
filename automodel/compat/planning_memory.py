"""torch internals behind the planner's memory count: torch's ``MemTracker``, made to accept a
module run several times per step, to keep CPU offload's host memory apart, and to leave out
what DTensor's shape propagation makes (``compat/planning.py`` has the rest)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref

from automodel.compat.core import Internal

_TOOLS = "torch.distributed._tools"
INTERNALS: list = []

_PLAN = "plan.py (the memory count of every simulated operator)"
_DISPATCH_NAMES = ("_fake_mode_on_entry", "_in_opt", "_in_ac", "is_bw", "_track",
                   "_update_peak_stats", "wait_tensor")
_OFFLOAD = "plan.py with parallelism.offload_policy (the memory FSDP2 keeps on the host)"
_FSDP = "torch.distributed.fsdp._fully_shard"
INTERNALS += [
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._update_snap", _OFFLOAD,
             params=("self", "u_type", "winfo", "old_mem_consumed", "old_reftype")),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._WINFO", _OFFLOAD, patched=False,
             assigned_in=True),
    # (rewritten on the tracker's records of host storages; patched=False: a public name
    # that automodel code elsewhere assigns on its own objects)
    Internal(f"{_TOOLS}.mem_tracker", "_WeakRefInfo.device", _OFFLOAD, patched=False,
             assigned_in=True),
    Internal(f"{_TOOLS}.mem_tracker", "_UpdateType", _OFFLOAD, patched=False),
    # the planner's own copy of the tracker's operator hook (``_tracker_class``) does what
    # torch's does with these of its names
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker.__torch_dispatch__", _PLAN,
             params=("self", "func", "types", "args", "kwargs"),
             check=lambda f: _names_used(f, _DISPATCH_NAMES)),
    Internal(f"{_TOOLS}.mem_tracker", "MemTracker._track", _PLAN,
             params=("self", "reftype", "t")),
    Internal(f"{_TOOLS}.common_utils", "get_untyped_storages", _OFFLOAD, patched=False,
             params=("t",)),
    Internal(f"{_FSDP}._fully_shard", "FSDPModule._get_fsdp_state", _OFFLOAD, patched=False,
             params=("self",)),
    Internal(f"{_FSDP}._fsdp_state", "FSDPState._fsdp_param_groups", _OFFLOAD,
             patched=False, assigned_in=True),
    Internal(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup.fsdp_params", _OFFLOAD,
             patched=False, assigned_in=True),
    Internal(f"{_FSDP}._fsdp_param", "FSDPParam.offload_to_cpu", _OFFLOAD, patched=False,
             assigned_in=True),
    Internal(f"{_FSDP}._fsdp_param", "FSDPParam._init_sharded_param", _OFFLOAD,
             patched=False, params=("self",),
             check=lambda f: None if "sharded_param" in inspect.unwrap(f).__code__.co_names
             else "no longer assigns sharded_param"),
]


def _names_used(f, names) -> str | None:
    used = set(inspect.unwrap(f).__code__.co_names)
    missing = [n for n in names if n not in used]
    return f"no longer uses {', '.join(missing)}" if missing else None


def offloaded_parameters(roots: list) -> list:
    """The sharded parameters FSDP2 keeps in host memory (``CPUOffloadPolicy``), of every
    FSDP module under ``roots`` (parameters it ignores stay on the device)."""
    from torch.distributed.fsdp import FSDPModule

    found: dict = {}
    for root in roots:
        for module in root.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    if fp.offload_to_cpu:
                        found[id(fp.sharded_param)] = fp.sharded_param
    return list(found.values())


def memory_tracker(roots: list, optimizers: list, host_params: list = ()):
    """torch's tracker of live tensor memory by kind (parameters, gradients, optimizer
    states, activations, temporaries), which knows ``roots``' parameters and the optimizers'
    states, and accepts a module run several times per step (gradient accumulation, pipeline
    micro-batches; torch's own refuses: its per-module statistics, which the planner does not
    use, would mix the runs).

    ``host_params`` (CPU offload: the parameters FSDP keeps in host memory): their storages,
    their gradients once FSDP has reduced them (``move_to_host``, from a gradient hook) and
    every optimizer state are counted in a memory of their own, ``HOST``, with its own peak;
    the rest is the device's. ``combined_peak`` is the peak of both together."""
    tracker = _tracker_class()()
    tracker.optimizer_on_host = bool(host_params)
    tracker.track_external(*roots, *optimizers)
    for p in host_params:
        tracker.move_to_host(p)
    return tracker


@functools.cache
def _tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(_lean_dispatch(), _step_peaks(), _host_memory(), MemTracker):
        # torch's module hooks, without their statistics per module and call (copies of the
        # whole memory's state, not used): what they do for the count is kept: a module's
        # parameters and buffers known at each of its forward runs (FSDP2 gathers them anew),
        # its inputs and outputs counted as activations, the region recomputed by activation
        # checkpointing told apart. A module may run several times per step (accumulation,
        # pipeline micro-batches).
        def _pre_fw_hook(self, module, inputs):
            if not self._mod_tracker.is_bw:
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
                self._track_inputs_or_outputs(inputs)
            elif self._ac_mod is None:  # (a forward in backward: a recomputation)
                self._ac_mod = weakref.ref(module)
                self._in_ac = True

        def _post_fw_hook(self, module, inputs, outputs):
            if not self._mod_tracker.is_bw:
                self._track_inputs_or_outputs(outputs)
            elif self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod = None
                self._in_ac = False

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # torch's registers a gradient hook on every parameter, which a frozen one
            # (``model.freeze``) refuses: a frozen parameter gets no gradient, so it is
            # entered as hooked already (with handles that remove nothing)
            for p in module.parameters():
                if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return StepMemTracker


def _lean_dispatch():
    """torch's operator hook of the tracker, leaner (the planner's most frequent frame: it
    ran a third of a simulation's time): the outputs walked without a pytree, the peak taken
    where memory grows (``_step_peaks``) instead of after every operator."""
    import torch
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.distributed.tensor import DTensor

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default

    class LeanDispatch:
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if DTensor in types:
                return NotImplemented  # (DTensor first turns it into operators on shards)
            if func is wait_tensor and active_fake_mode():
                res = args[0]  # (the fake kernel makes a new tensor; a real wait does not)
            else:
                res = func(*args, **(kwargs or {}))
            if in_sharding_propagation() or active_fake_mode() is not self._fake_mode_on_entry:
                return res  # (DTensor's shape propagation: no tensor of the rank)
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            for t in _tensors(res):
                self._track(reftype, t)
            return res

    return LeanDispatch


def _step_peaks():
    """The whole rank's peak, taken whenever memory grows, and a second one while the
    optimizer steps (its states, the gradients and its temporaries: a peak of its own, which
    the search's probes measure apart)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, _UpdateType

    class StepPeaks:
        optimizer_peak: dict

        def __init__(self):
            super().__init__()
            self.optimizer_peak = {}

        def __enter__(self):
            if self._depth == 0:  # (a new measurement, as torch's resets its peaks)
                self.optimizer_peak = {}
            return super().__enter__()

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            if u_type != _UpdateType.DEL:  # (memory grew, or moved between kinds)
                self._update_peak_stats(None)

        def _update_peak_stats(self, peak_state):
            # torch's also walks every module's statistics (most of a large model's planning
            # time), which the planner does not use
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                if self._in_opt and self.optimizer_peak.get(dev, 0) < snap[_TOTAL_KEY]:
                    self.optimizer_peak[dev] = snap[_TOTAL_KEY]
            self._update_combined_peak()

    return StepPeaks


def _tensors(out) -> list:
    """The tensors an operator returned: itself, or those of its (nested) list or tuple."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    found: list = []
    if isinstance(out, (list, tuple)):
        for x in out:
            found += _tensors(x) if isinstance(x, (list, tuple)) else \
                [x] if isinstance(x, torch.Tensor) else []
    return found


def host_memory_device():
    """The key under which the tracker counts host memory (CPU offload), apart from the
    simulated device's ``cpu``: a device index no simulated tensor has."""
    import torch

    return torch.device("cpu", 1)


def _host_memory():
    """The tracker's second memory, the host's (CPU offload), and its peak of both."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import (
        _TOTAL_KEY,
        MemTracker,
        _MemRefType,
        _UpdateType,
    )

    host = host_memory_device()

    class HostMemory:
        optimizer_on_host = False
        combined_peak, combined_peak_snap = 0, {}

        def __enter__(self):
            if self._depth == 0:  # (torch's resets the devices' peaks to the current state)
                self.combined_peak, self.combined_peak_snap = 0, {}
                self._update_combined_peak()
            return super().__enter__()

        def _update_combined_peak(self) -> None:
            total = sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())
            if total > self.combined_peak or not self.combined_peak_snap:
                self.combined_peak = total
                self.combined_peak_snap = {d: dict(s) for d, s in self._curr_mem_snap.items()}

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            # under CPU offload the optimizer steps on the host: its states live there
            opt = self.optimizer_on_host and winfo.reftype == _MemRefType.OPT
            if opt and u_type == _UpdateType.ADD:
                winfo.device = host
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            if opt and u_type == _UpdateType.REF:
                self._relocate(winfo)

        def move_to_host(self, t) -> None:
            """``t``'s storages counted in the host's memory from now on."""
            for st in get_untyped_storages(t):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None:
                    self._relocate(winfo)

        def _relocate(self, winfo) -> None:
            if winfo.device == host:
                return
            if winfo.mem_consumed > 0:
                MemTracker._update_snap(self, _UpdateType.DEL, winfo)
            winfo.device = host
            if winfo.mem_consumed > 0:
                MemTracker._update_snap(self, _UpdateType.ADD, winfo)
                self._update_peak_stats(None)

    return HostMemory


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


def peak_snapshots(tracker) -> dict:
    """{kind name: bytes} ("Total": all kinds) at three peaks: ``device`` (the simulated
    device's own), ``host`` (the host memory of CPU offload; empty without it) and ``all``
    (both together, the peak a run that keeps everything in one memory has)."""
    host = host_memory_device()
    peaks = tracker.get_tracker_snapshot("peak")
    return {"device": _by_name(s for d, s in peaks.items() if d != host),
            "host": _by_name(s for d, s in peaks.items() if d == host),
            "all": _by_name(tracker.combined_peak_snap.values())}


def optimizer_peak_bytes(tracker) -> int:
    """The simulated device's peak while the optimizer stepped (0: it did not step)."""
    host = host_memory_device()
    return sum(n for d, n in tracker.optimizer_peak.items() if d != host)


def _by_name(snaps) -> dict:
    out: dict = {}
    for per_kind in snaps:
        for kind, n in per_kind.items():
            name = kind if isinstance(kind, str) else kind.value
            out[name] = out.get(name, 0) + n
    return out


