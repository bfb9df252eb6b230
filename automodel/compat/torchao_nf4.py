"""torchao's NF4 tensor (QLoRA's 4-bit weights, ``automodel/peft/nf4.py``): what automodel
reads of it, and the one op it replaces.

torchao's ``clone`` of an NF4 tensor dequantizes it and quantizes it again with the default
block sizes: a copy of a weight quantized with other sizes fails (or holds other values), and
the pipeline split deep-copies the model for each stage. ``patch_nf4_clone`` makes ``clone``
copy the 4-bit values and scales as they are (exact, and no dequantization)."""

from __future__ import annotations

from automodel.compat.core import Internal

NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
_CLONE = "peft=qlora under a pipeline (a stage is a copy of the model; the copy of an NF4 " \
         "weight keeps its values and block sizes)"

INTERNALS: list[Internal] = [
    Internal(NF4_MODULE, "NF4_OPS_TABLE", _CLONE, kind=dict),
    Internal(NF4_MODULE, "construct_nf4_args", _CLONE, patched=False,
             params=("nf4tensor", "kwargs")),
    Internal(NF4_MODULE, "to_nf4", "peft=qlora (quantizing the adapted layers' weights)",
             patched=False, params=("tensor", "block_size", "scaler_block_size")),
    Internal(NF4_MODULE, "NF4Tensor.fsdp_pre_all_gather", "peft=qlora under FSDP2 (the 4-bit "
             "values gathered, not a dequantized copy)", patched=False, params=("self", "mesh")),
    Internal(NF4_MODULE, "NF4Tensor.get_original_weight", "peft=qlora (the merged export, "
             "dequantized weights)", patched=False, params=("self",)),
]

INNER = ("quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4")


def patch_nf4_clone(module) -> None:
    """``clone`` of an NF4 tensor: its inner tensors cloned (``module``: torchao's NF4 module,
    imported). Idempotent."""
    import torch

    table = module.NF4_OPS_TABLE
    op = torch.ops.aten.clone.default
    if getattr(table.get(op), "automodel_exact", False):
        return

    def clone(func, args, kwargs=None):
        t = args[0]
        return module.NF4Tensor(*module.construct_nf4_args(
            t, {name: getattr(t, name).clone() for name in INNER}))

    clone.automodel_exact = True
    table[op] = clone
