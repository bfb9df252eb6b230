"""Patches of transformers and torch internals that some strategies ask for."""

from __future__ import annotations

import contextlib


def _never_packed(position_ids, batch_size):
    return False


def patch_is_packed_sequence() -> None:
    """Make transformers' ``_is_packed_sequence`` always return a Python ``False``.

    Removes a device sync per attention layer and keeps attention shapes static for compile.
    Only for unpacked training (position ids that never restart mid-sequence).
    """
    from transformers import modeling_flash_attention_utils as fa_utils

    fa_utils._is_packed_sequence = _never_packed


def is_packed_sequence_patched() -> bool:
    from transformers import modeling_flash_attention_utils as fa_utils

    return fa_utils._is_packed_sequence is _never_packed


def keep_output_recording(module, original_class: type) -> None:
    """After FSDP2 gave ``module`` a class of its own (``FSDP<name>``): record its outputs as
    its original class does. transformers finds what a model records (hidden states,
    attentions) by the name of its class, so a sharded sub-model such as a vision tower would
    otherwise return no hidden states (and LLaVA, which selects one of them, fails)."""
    from transformers.utils import output_capturing

    registry = output_capturing._CAN_RECORD_REGISTRY
    key = str(original_class)
    if type(module) is not original_class and key in registry:
        dict.__setitem__(registry, str(type(module)), registry[key])


@contextlib.contextmanager
def building_mesh_outside_this_rank():
    """While this rank builds a DeviceMesh it is not part of (another model's mesh, in a job
    that holds several models): torch creates each process group of a mesh with every rank of
    the job, so this rank must build the mesh too. Torch keeps such a rank outside (no
    coordinate, no groups), but slicing or flattening a mesh of several rows asks for the row
    that holds this rank, and raises. Any row serves its checks there (sizes only): the first."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__["_get_mesh_tensor_from_full_mesh"]

    def any_row(full_mesh, current_rank=None):
        try:
            return original.__func__(full_mesh, current_rank)
        except RuntimeError:  # (this rank holds no row)
            return full_mesh[0]

    DeviceMesh._get_mesh_tensor_from_full_mesh = staticmethod(any_row)
    try:
        yield
    finally:
        DeviceMesh._get_mesh_tensor_from_full_mesh = original
