"""Internals of transformers that automodel patches or reads."""

from __future__ import annotations

import contextlib

from automodel.compat.core import Internal

_FA = "transformers.modeling_flash_attention_utils"
_CAPTURE = "transformers.utils.output_capturing"

INTERNALS = [
    Internal(_FA, "_is_packed_sequence", "parallelism.patch_is_packed_sequence",
             params=("position_ids", "batch_size")),
    Internal("transformers.masking_utils", "find_packed_sequence_indices",
             "the packed-sequence answer without a device sync (every training step, "
             "data.pack_boundaries)", params=("position_ids",)),
    Internal(_CAPTURE, "_CAN_RECORD_REGISTRY",
             "FSDP2 sharding of a sub-model that records outputs (a vision tower's hidden "
             "states)", kind=dict),
    Internal("transformers", "PreTrainedModel._can_set_attn_implementation",
             "context parallelism (mesh.cp_size>1): refusing models outside the attention "
             "interface", patched=False, params=()),
    Internal("transformers.core_model_loading", "revert_weight_conversion",
             "the Hugging Face export (each file's tensors under the names and shapes "
             "save_pretrained writes)", patched=False, params=("model", "state_dict")),
    Internal("transformers", "AutoModelForCausalLM._model_mapping",
             "the pre-launch model check (which configs build a causal LM)", patched=False,
             check=lambda m: None if hasattr(m, "__contains__") and hasattr(m, "__getitem__")
             else "not a mapping"),
]


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


@contextlib.contextmanager
def packed_sequence_finder(finder):
    """While the model runs: transformers' ``masking_utils.find_packed_sequence_indices`` is
    ``finder`` (no change where this transformers has none)."""
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = finder
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


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


def can_set_attn_implementation(model) -> bool:
    """Whether ``model`` runs its attention through transformers' attention interface."""
    return model._can_set_attn_implementation()


def has_causal_lm(config) -> bool:
    """Whether ``AutoModelForCausalLM`` has a class for ``config``."""
    from transformers import AutoModelForCausalLM

    return type(config) in AutoModelForCausalLM._model_mapping


def causal_lm_class(config):
    """The class ``AutoModelForCausalLM`` builds for ``config`` (``has_causal_lm`` first)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)]


def input_embeddings(model):
    """``model.get_input_embeddings()``, or None where the model holds none: a pipeline stage
    after the first, whose embedding was removed (transformers' automatic lookup raises
    ``NotImplementedError`` for some families' language models then, e.g. Qwen2-VL's)."""
    try:
        return model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None


def saved_layout(model, state: dict) -> dict:
    """``state`` (some of ``model``'s tensors, under its names) as ``save_pretrained`` writes
    them: the renames and splits transformers applies when it loads reverted (an image-text
    model's ``language_model.model.*``, a MoE model's experts one by one)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state)
