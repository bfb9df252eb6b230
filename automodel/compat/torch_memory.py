"""What automodel's real-run measurements read: the storage method that the CPU count of
tensor bytes follows (``tracking/memory.py``), and c10d's flight recorder, which records each
collective with its process group (``trainer.profile_steps``, ``planning/measured.py``)."""

from __future__ import annotations

import contextlib

from automodel.compat.core import Internal

_FEATURE = "peak_tensor_bytes on the CPU (a dispatch mode counting tensor storages)"

INTERNALS = [
    Internal("torch", "UntypedStorage.resize_", "peak_tensor_bytes on the CPU (storages "
             "resized in place, as FSDP2 frees and refills its unsharded parameters)",
             params=()),
    Internal("torch.utils._python_dispatch", "TorchDispatchMode", _FEATURE, patched=False,
             kind=type),
    Internal("torch.utils._python_dispatch", "is_traceable_wrapper_subclass", _FEATURE,
             patched=False, params=("t",)),
    Internal("torch.utils._python_dispatch", "is_traceable_wrapper_subclass_type", _FEATURE,
             patched=False, params=("t",)),
    Internal("torch.utils._pytree", "tree_leaves", _FEATURE, patched=False,
             params=("tree",)),
    Internal("torch.utils._pytree", "tree_map_only", "a later pipeline stage's stand-ins for "
             "the first stage's modules (shapes through a meta-device copy)", patched=False,
             params=("type_or_types_or_pred", "func", "tree")),
    Internal("torch._C._distributed_c10d", "_dump_fr_trace", "trainer.profile_steps (each "
             "collective's process group, from c10d's flight recorder)", patched=False,
             params=()),
]

# c10d's flight recorder records collectives when this is set before a process group starts
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"


def flight_recorder_entries() -> list[dict]:
    """c10d's flight recorder: the collectives this process issued (the newest, up to the
    buffer's size), each with ``process_group`` (name, description), ``profiling_name``
    ("gloo:all_gather"), sizes, dtypes and ``time_created_ns``; [] when it was off."""
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    try:
        dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False))
    except RuntimeError:  # (no recorder)
        return []
    return list(dump.get("entries", []))


def dispatch_mode_base() -> type:
    """torch's base class of a dispatch mode (it sees every operator run inside it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def is_tensor_subclass(t) -> bool:
    """``t`` (a tensor) is a wrapper subclass (a DTensor) over inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def is_tensor_subclass_type(cls: type) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

    return is_traceable_wrapper_subclass_type(cls)


def tensor_leaves(tree) -> list:
    """The leaves of an operator's output (nested tuples, lists, dicts)."""
    from torch.utils._pytree import tree_leaves

    return tree_leaves(tree)


def map_tensors(fn, tree):
    """``tree`` (nested tuples, lists, dicts, model outputs) with ``fn`` applied to each
    tensor."""
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fn, tree)


@contextlib.contextmanager
def watch_storage_resizes(callback):
    """Inside, ``callback(storage)`` follows every ``UntypedStorage.resize_`` (which no
    dispatch mode sees); nested uses chain, and each restores what it found."""
    import torch

    cls = torch.UntypedStorage
    own = "resize_" in vars(cls)
    found = cls.resize_

    def resize_(st, size):
        out = found(st, size)
        callback(st)
        return out

    cls.resize_ = resize_
    try:
        yield
    finally:
        if own:
            cls.resize_ = found
        else:
            del cls.resize_
