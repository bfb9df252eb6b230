"""``peak_tensor_bytes``: the peak of the bytes held by live tensors on a rank.

On a GPU the CUDA allocator counts them (``torch.cuda.max_memory_allocated``, its peak reset
at each step's read). The CPU allocator keeps no such count, so on the CPU ``LiveTensorBytes``
counts them in real mode, by a method of its own (not torch's ``MemTracker``, which the
planner uses under ``FakeTensorMode``, and never the process's resident set):

- at the start, what a device would hold between steps: the model's parameters, buffers and
  gradients and the optimizers' states, counted once per storage (host-side data, such as
  a dataset's token rows, would not be on a GPU and is not counted; the step's batches are,
  when the step starts);
- while it is entered (a dispatch mode), every storage an operator returns is counted once,
  until the storage dies (a weak reference's callback); an operator on a tensor subclass
  (a DTensor) is left to the subclass, so the mode sees the operators on its local tensors
  (a redistribution's buffers included);
- a storage that grows or shrinks in place (``UntypedStorage.resize_``, which FSDP2 uses to
  free and refill its unsharded parameters, and which no dispatch mode sees) is followed
  through ``compat.watch_storage_resizes``.

Counted: the bytes of each storage on the rank's device type, once however many tensors view
it. Not counted: memory that is no tensor (the process, gloo's buffers, a kernel's internal
scratch space that it allocates without making a tensor).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from automodel.compat import (
    dispatch_mode_base,
    is_tensor_subclass,
    is_tensor_subclass_type,
    tensor_leaves,
    watch_storage_resizes,
)

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class LiveTensorBytes(dispatch_mode_base()):
    """Live tensor bytes on ``device_type``: ``current``, and ``peak`` since ``reset_peak``.

    ``start()`` counts what is alive; then each ``with tracker:`` block counts what its
    operators make (the count of storages made outside such a block, and still alive, is
    kept: they are only missed while they were made)."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._live: dict[int, list] = {}  # id(storage) -> [weak reference, bytes]
        self._lock = threading.RLock()  # (a storage may die on another thread)
        self._resizes = None

    def start(self, modules=(), optimizers=()) -> "LiveTensorBytes":
        """Count the tensors ``modules`` (parameters, their gradients, buffers) and
        ``optimizers`` (states) hold now; the peak starts there."""
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                self.note(t)
                if t.grad is not None:
                    self.note(t.grad)
        for opt in optimizers:
            for state in opt.state.values():
                for t in tensor_leaves(state):
                    if isinstance(t, torch.Tensor):
                        self.note(t)
        self.peak = self.current
        return self

    def reset_peak(self) -> None:
        self.peak = self.current

    def note(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (a subclass: its inner tensors') unless counted already."""
        if type(t) not in _PLAIN and is_tensor_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            for name in attrs:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self.note(inner)
            return
        if t.device.type != self.device_type:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # (no storage: sparse, nested)
            return
        self._set(st)

    def _set(self, st) -> None:
        key, size = id(st), st.nbytes()
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                ref = weakref.ref(st, lambda _, k=key: self._forget(k))
                self._live[key] = [ref, size]
                self._add(size)
            elif entry[1] != size:
                self._add(size - entry[1])
                entry[1] = size

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry[1]

    def _add(self, size: int) -> None:
        self.current += size
        if self.current > self.peak:
            self.peak = self.current

    def _resized(self, st) -> None:
        if st.device.type == self.device_type:
            self._set(st)

    def __enter__(self):
        self._resizes = watch_storage_resizes(self._resized)
        self._resizes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._resizes.__exit__(*exc)
            self._resizes = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and any(is_tensor_subclass_type(t) for t in types):
            return NotImplemented  # the subclass runs its local operators, which come here
        out = func(*args, **(kwargs or {}))
        if type(out) in _PLAIN:
            self.note(out)
        elif out is not None:
            for t in (out if type(out) in (tuple, list) else tensor_leaves(out)):
                if isinstance(t, torch.Tensor):
                    self.note(t)
        return out


class TensorPeak:
    """A rank's ``peak_tensor_bytes``: the peak of its live tensor bytes in each window
    between two ``read()`` calls (the runner reads once per step). On a GPU the CUDA
    allocator's count (its peak restarts at each read; ``so_far`` keeps the largest); on the
    CPU a ``LiveTensorBytes`` count, entered by ``window()`` around each step."""

    def __init__(self, device: torch.device, count_cpu: bool, modules=(), optimizers=()):
        self.device = device
        self.so_far = 0
        self.tracker = None
        if device.type != "cuda" and count_cpu:
            self.tracker = LiveTensorBytes(device.type).start(modules, optimizers)

    @property
    def enabled(self) -> bool:
        return self.device.type == "cuda" or self.tracker is not None

    def window(self, tensors=()):
        """Around a step's work; ``tensors``: ones made outside (the step's batches)."""
        if self.tracker is None:
            return contextlib.nullcontext()
        for t in tensor_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self.tracker.note(t)
        return self.tracker

    def read(self) -> int | None:
        """The peak since the last read (None: not counted); the next window starts."""
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.tracker is not None:
            peak = self.tracker.peak
            self.tracker.reset_peak()
        else:
            return None
        self.so_far = max(self.so_far, peak)
        return peak


def tensor_peak_for(device: torch.device, setting: bool | None, modules=(),
                    optimizers=()) -> TensorPeak | None:
    """``trainer.track_tensor_memory``: null = a GPU counts (the CPU does not), true = the
    CPU counts too (from what ``modules`` and ``optimizers`` hold), false = neither."""
    if setting is False:
        return None
    peak = TensorPeak(device, bool(setting), modules, optimizers)
    return peak if peak.enabled else None
