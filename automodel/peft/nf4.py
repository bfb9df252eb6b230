"""QLoRA's base weights: the adapted layers' weights stored in 4-bit NF4 (``peft=qlora``).

The format is torchao's ``NF4Tensor`` (QLoRA's NormalFloat-4 with double quantization): the
weight, flattened, in blocks of ``nf4_block_size`` values, each value one of 16 levels of its
block's absolute maximum (4 bits), the block maxima quantized to 8 bits in groups of
``nf4_scaler_block_size`` blocks around their mean. About half a byte per value; ``F.linear``
dequantizes the weight to the input's dtype on use and its backward gives the input's gradient
only (the weight is frozen). torchao's tensor is chosen because it is a torch tensor subclass
kept by torchao (PyTorch's own quantization library), runs on the CPU, and implements FSDP2's
all-gather extension: FSDP2 shards it by rows and gathers the 4-bit bytes, not a dequantized
copy.

A weight is quantized whole, once, with the same blocks in every layout: a rank's FSDP2 shard
is then a run of whole scale groups of the full tensor (``fill``), which is why a shard must
hold whole groups (``nf4_refusal``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from automodel.compat.torchao_nf4 import patch_nf4_clone, patch_one_rank_unshard

_SHARDED = ("quantized_data", "quantization_factor", "quantized_scalers")  # split by rows
_WHOLE = ("scaler_mean", "nf4")  # one value / the 16 levels: every shard holds them


def _torchao():
    """torchao's NF4 module (imported on first use; its ``clone`` made exact, and FSDP2's
    one-rank unshard given every inner tensor)."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    patch_nf4_clone(nf4_tensor)
    patch_one_rank_unshard()
    return nf4_tensor


def is_nf4(t: torch.Tensor) -> bool:
    """An NF4 weight, or a DTensor (FSDP2 shard) of one."""
    return type(_local(t)).__name__ == "NF4Tensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    from automodel.compat import local_tensor

    return local_tensor(t) if isinstance(t, DTensor) else t


def to_nf4(weight: torch.Tensor, block_size: int, scaler_block_size: int) -> torch.Tensor:
    if weight.is_meta and weight.numel() % (block_size * scaler_block_size) == 0:
        return _meta_nf4(weight, block_size, scaler_block_size)
    return _torchao().to_nf4(weight.detach().contiguous(), block_size, scaler_block_size)


def _meta_nf4(weight: torch.Tensor, block_size: int, scaler_block_size: int) -> torch.Tensor:
    """The NF4 form of a weight on the meta device (no values), made from one scale group's:
    torchao quantizes in chunks, a Python loop as long as the weight even where there are no
    values (0.75 s for each weight of a 70B layer, a model build's minutes). Every inner
    tensor split by rows is a run of the group's, one per group of the weight."""
    module = _torchao()
    one = _one_group(weight.dtype, block_size, scaler_block_size)
    groups = weight.numel() // (block_size * scaler_block_size)
    inner = {name: torch.empty(getattr(one, name).numel() * groups,
                               dtype=getattr(one, name).dtype, device="meta")
             for name in _SHARDED}
    inner.update({name: getattr(one, name).clone() for name in _WHOLE})
    return module.NF4Tensor(*module.construct_nf4_args(one, {
        **inner, "size": weight.size(), "stride": weight.contiguous().stride(),
        "n_blocks": weight.numel() // block_size}))


@functools.lru_cache(maxsize=None)
def _one_group(dtype: torch.dtype, block_size: int, scaler_block_size: int) -> torch.Tensor:
    """torchao's NF4 form of one scale group on the meta device."""
    group = block_size * scaler_block_size
    return _torchao().to_nf4(torch.empty(1, group, dtype=dtype, device="meta"), block_size,
                             scaler_block_size)


def quantize(module: nn.Linear, block_size: int, scaler_block_size: int) -> None:
    """Replace ``module``'s weight with its NF4 form, frozen (on the meta device: the form
    without values, filled later by ``fill``)."""
    module.weight = nn.Parameter(to_nf4(module.weight, block_size, scaler_block_size),
                                 requires_grad=False)


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The weight an NF4 tensor (or an FSDP2 shard of one) stands for, in its dtype; any
    other ``weight`` as it is."""
    from torch.distributed.tensor import DTensor

    if not is_nf4(weight):
        return weight
    if isinstance(weight, DTensor):
        return DTensor.from_local(_local(weight).get_original_weight(), weight.device_mesh,
                                  weight.placements, run_check=False, shape=weight.shape,
                                  stride=weight.stride())
    return weight.get_original_weight()


@torch.no_grad()
def fill(target: torch.Tensor, full: torch.Tensor) -> None:
    """Quantize ``full`` (the whole weight) and put it, or this rank's rows of it where
    ``target`` is an FSDP2 shard (a DTensor split by rows), into ``target``."""
    from torch.distributed.tensor import DTensor

    from automodel.compat import local_shape_and_offset

    local = _local(target)
    quantized = to_nf4(full.to(target.dtype), local.block_size, local.scaler_block_size)
    if isinstance(target, DTensor):
        (rows, *_), (first, *_) = local_shape_and_offset(full.shape, target.device_mesh,
                                                          target.placements)
        quantized = quantized.split(rows)[first // rows]
    for name in _SHARDED:
        getattr(local, name).copy_(getattr(quantized, name))
    for name in _WHOLE:  # (allocated on the meta device still: to_empty leaves them)
        setattr(local, name, getattr(quantized, name).clone())


def nf4_refusal(name: str, shape: tuple, block_size: int, scaler_block_size: int,
                shards: int) -> str | None:
    """Why layer ``name``'s weight of ``shape`` cannot be stored in NF4 split over ``shards``
    FSDP2 ranks (None: it can)."""
    numel = shape[0] * shape[1]
    group = block_size * scaler_block_size
    if numel % group:
        return (f"{name}'s weight {list(shape)} ({numel} values) is not a whole number of NF4 "
                f"scale groups of peft.nf4_block_size x peft.nf4_scaler_block_size = "
                f"{block_size} x {scaler_block_size} = {group} values: choose sizes whose "
                "product divides it")
    if shards > 1 and (shape[0] % shards or (numel // group) % shards):
        return (f"{name}'s weight {list(shape)} in NF4 does not split into {shards} FSDP2 "
                f"shards of whole rows and whole scale groups ({numel // group} groups of "
                f"{group} values): choose a smaller peft.nf4_scaler_block_size or "
                "nf4_block_size, or fewer ranks sharding parameters (dp_shard x cp)")
    return None


def allocate_whole(parts: list) -> None:
    """Give every NF4 weight of ``parts`` allocated after ``to_empty`` its scale mean and its
    16 levels on the weights' device (``to_empty`` allocates only the inner tensors that are
    split by rows; the planner's fake step has no ``fill`` to set them)."""
    for part in parts:
        for p in part.parameters():
            local = _local(p)
            if is_nf4(p) and not local.quantized_data.is_meta:
                device = local.quantized_data.device
                for name in _WHOLE:
                    if getattr(local, name).is_meta:
                        setattr(local, name, torch.empty_like(getattr(local, name),
                                                              device=device))


def stored_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: an NF4 weight's (or shard's) 4-bit values, scales and levels;
    numel x element size otherwise."""
    local = _local(t)
    if not is_nf4(local):
        return local.numel() * local.element_size()
    return sum(getattr(local, n).numel() * getattr(local, n).element_size()
               for n in (*_SHARDED, *_WHOLE))
