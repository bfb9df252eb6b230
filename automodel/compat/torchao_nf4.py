"""torchao's NF4 tensor (QLoRA's 4-bit weights, ``automodel/peft/nf4.py``): what automodel
reads of it, and the one op it replaces.

torchao's ``clone`` of an NF4 tensor dequantizes it and quantizes it again with the default
block sizes: a copy of a weight quantized with other sizes fails (or holds other values), and
the pipeline split deep-copies the model for each stage. ``patch_nf4_clone`` makes ``clone``
copy the 4-bit values and scales as they are (exact, and no dequantization).

FSDP2 on one rank (``parallelism=fsdp2`` on one GPU) skips the all-gather and copies each
parameter's first all-gather input into its unsharded buffer, so a tensor whose all-gather
extension has several inputs (NF4: scales, factors and 4-bit values) gets one output and its
``fsdp_post_all_gather`` fails ("expected 3, got 1"). ``patch_one_rank_unshard`` copies every
input there, as a gather over one rank would."""

from __future__ import annotations

from automodel.compat.core import Internal

NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
_CLONE = "peft=qlora under a pipeline (a stage is a copy of the model; the copy of an NF4 " \
         "weight keeps its values and block sizes)"

INTERNALS: list[Internal] = [
    Internal(NF4_MODULE, "NF4_OPS_TABLE", _CLONE, kind=dict),
    Internal(NF4_MODULE, "construct_nf4_args", _CLONE + "; peft=qlora on the meta device (a "
             "weight's NF4 form made from one scale group's)", patched=False,
             params=("nf4tensor", "kwargs")),
    Internal(NF4_MODULE, "to_nf4", "peft=qlora (quantizing the adapted layers' weights)",
             patched=False, params=("tensor", "block_size", "scaler_block_size")),
    Internal(NF4_MODULE, "NF4Tensor.fsdp_pre_all_gather", "peft=qlora under FSDP2 (the 4-bit "
             "values gathered, not a dequantized copy)", patched=False, params=("self", "mesh")),
    Internal(NF4_MODULE, "NF4Tensor.get_original_weight", "peft=qlora (the merged export, "
             "dequantized weights)", patched=False, params=("self",)),
]

_FSDP = "torch.distributed.fsdp._fully_shard"
_ONE_RANK = "peft=qlora under FSDP2 on one rank (every NF4 inner tensor put in the unsharded " \
            "weight)"
INTERNALS += [
    Internal(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup.wait_for_unshard", _ONE_RANK,
             params=("self",)),
    Internal(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup._all_gather_process_group",
             _ONE_RANK, patched=False, kind=property),
    Internal(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup._all_gather_result", _ONE_RANK,
             patched=False, assigned_in=True),
    Internal(f"{_FSDP}._fsdp_param", "FSDPParam.all_gather_inputs", _ONE_RANK, patched=False,
             kind=property),
    Internal(f"{_FSDP}._fsdp_param", "FSDPParam.init_all_gather_outputs", _ONE_RANK,
             patched=False, params=("self", "all_gather_input_numels",
                                    "all_gather_input_dtypes", "world_size", "device")),
    Internal(f"{_FSDP}._fsdp_param", "alloc_storage", _ONE_RANK, patched=False,
             params=("tensor",)),
    Internal(f"{_FSDP}._fsdp_common", "FSDPMeshInfo", _ONE_RANK, patched=False, kind=type),
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


def patch_one_rank_unshard() -> None:
    """FSDP2's unshard on a one-rank mesh fills every all-gather output of a parameter with
    several inputs (an NF4 weight's), not only the first. Idempotent."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param as fsdp_param
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    original = FSDPParamGroup.wait_for_unshard
    if getattr(original, "automodel_every_input", False):
        return

    def wait_for_unshard(self):
        result = self._all_gather_result
        if result and result.all_gather_work is None and _one_rank(self):
            for param in self.fsdp_params:
                inputs = param.all_gather_inputs
                if len(inputs) < 2:
                    continue  # (torch's own path does these)
                param.init_all_gather_outputs([t.numel() for t in inputs],
                                              [t.dtype for t in inputs], 1, self.device)
                for out, given in zip(param.all_gather_outputs, inputs):
                    fsdp_param.alloc_storage(out)
                    with torch.autograd._unsafe_preserve_version_counter(out):
                        out.copy_(given)
        return original(self)

    wait_for_unshard.automodel_every_input = True
    FSDPParamGroup.wait_for_unshard = wait_for_unshard


def _one_rank(group) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    return (not isinstance(group.mesh_info, FSDPMeshInfo)
            or group._all_gather_process_group.size() == 1)
