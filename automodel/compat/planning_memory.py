"""torch internals behind the planner's memory count: torch's ``MemTracker``, made to accept a
module run several times per step, to keep CPU offload's host memory apart, and to leave out
what DTensor's shape propagation makes (``compat/planning.py`` has the rest)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

from automodel.compat.core import Internal

_TOOLS = "torch.distributed._tools"
INTERNALS: list = []

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
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class StepMemTracker(_host_memory(), MemTracker):
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
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
            self._update_combined_peak()

    return StepMemTracker


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


def _by_name(snaps) -> dict:
    out: dict = {}
    for per_kind in snaps:
        for kind, n in per_kind.items():
            name = kind if isinstance(kind, str) else kind.value
            out[name] = out.get(name, 0) + n
    return out


