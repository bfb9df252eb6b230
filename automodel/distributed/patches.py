"""Patches of transformers internals that some strategies ask for."""

from __future__ import annotations


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
