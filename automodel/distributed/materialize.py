"""Meta-device construction: shard first, then allocate only this rank's slices and fill them.

Every rank builds the model with its parameters on the meta device (no memory; buffers such
as rotary frequencies are computed for real), and ``parallelize`` splits it into stages and
applies TP/FSDP2 there. Then this rank's shards are allocated on its device (``to_empty``) and
filled, one of two ways:

- ``load_slices``: from a pretrained safetensors checkpoint, every rank reads only the slices
  its shards hold from the memory-mapped files. Nothing is broadcast and no full copy exists
  anywhere (the page cache holds the files once per node).
- ``materialize``: otherwise (from config, or a checkpoint in another format) rank 0 alone
  builds the whole model on the host (from config with the run's seed, or
  ``from_pretrained``) and broadcasts one tensor at a time; every rank keeps its slices.
  Initial weights from config must be bit-identical to a single-process run of the same seed,
  which only a full, sequential initialization gives. The cost: one full copy in rank 0's host
  memory (the node's host holds at most one), the model's bytes broadcast once, and one full
  tensor in flight on each rank. Buffers travel the same way, and rank 0's random-number state
  after initialization is given to every rank, as if each had built the model itself.

``benchmarks/host_memory.py`` measures both against every rank loading the whole model.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from automodel.compat import local_shape_and_offset, local_tensor, unwrapped_name
from automodel.config.schema import ModelConfig
from automodel.peft import nf4
from automodel.peft.lora import is_adapter
from automodel.peft.nf4 import is_nf4


def _targets(parts: list[nn.Module]) -> dict[str, list[torch.Tensor]]:
    """Every parameter and buffer of this rank's parts by its (unsplit) name; tied weights and
    a weight held by two parts appear under each of their names. Adapters are not among them
    (``automodel.peft.init_adapters`` fills those, from their own seeds)."""
    out: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for name, t in [*part.named_parameters(remove_duplicate=False),
                        *part.named_buffers(remove_duplicate=False)]:
            if not is_adapter(_clean(name)):
                out.setdefault(_clean(name), []).append(t)
    return out


def _clean(name: str) -> str:
    """Names as the unwrapped model has them (activation checkpointing wraps blocks)."""
    return unwrapped_name(name)


@torch.no_grad()
def fill_from_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full tensor, or this rank's slice of it where ``target`` is a DTensor (a
    QLoRA weight: quantized whole, then sliced)."""
    if is_nf4(target):
        nf4.fill(target, full)
    elif isinstance(target, DTensor):
        piece = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        local_tensor(target).copy_(local_tensor(piece))
    else:
        target.copy_(full)


def full_initial_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The whole model's initial parameters and buffers, on the host (rank 0 only)."""
    from automodel.models.builder import build_model

    model = build_model(cfg, seed)
    return {**model.state_dict(), **dict(model.named_buffers())}


def _local_window(target: DTensor, shape) -> tuple | None:
    """The slice of the full tensor this rank's shard holds, when it is one block."""
    if not all(type(p) in (Shard, Replicate) for p in target.placements):
        return None  # e.g. FSDP2 over TP (strided shards): read whole, keep the slice
    local, offset = local_shape_and_offset(shape, target.device_mesh, target.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local))


def names_match(model: nn.Module, files: dict[str, str]) -> bool:
    """Whether a safetensors checkpoint stores every weight under the model's own parameter
    names. Some families store others (LLaVA: ``language_model.model.*`` for the module
    ``model.language_model.*``) and rename them while loading; those are loaded whole by
    rank 0 (``materialize``) instead of sliced."""
    names: dict[int, list[str]] = {}  # every name of each parameter (tied ones have several)
    for name, p in model.named_parameters(remove_duplicate=False):
        if not is_adapter(_clean(name)):
            names.setdefault(id(p), []).append(_clean(name))
    return all(any(n in files for n in found) for found in names.values())


@torch.no_grad()
def load_slices(parts: list[nn.Module], device: torch.device, files: dict[str, str]) -> None:
    """Fill ``parts`` (built on meta, already sharded) from a safetensors checkpoint, each rank
    reading only the slices its shards hold (the files are memory-mapped: no full copy of the
    model, nothing broadcast). Buffers keep the values the meta build computed (on the host).
    Not collective."""
    from safetensors import safe_open

    buffers = {n: b.detach().clone() for part in parts
               for n, b in part.named_buffers(remove_duplicate=False) if not b.is_meta}
    for part in parts:
        part.to_empty(device=device)
    for part in parts:
        for name, b in part.named_buffers(remove_duplicate=False):
            if name in buffers:
                b.copy_(buffers[name])
    by_object: dict[int, list[str]] = {}
    params = [(_clean(n), p) for part in parts
              for n, p in part.named_parameters(remove_duplicate=False)
              if not is_adapter(_clean(n))]
    for name, p in params:
        by_object.setdefault(id(p), []).append(name)
    handles: dict[str, object] = {}
    for name, p in params:
        key = next((k for k in [name, *by_object[id(p)]] if k in files), None)
        if key is None:  # (a tied weight is stored under one of its names)
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        if files[key] not in handles:
            handles[files[key]] = safe_open(files[key], framework="pt")
        stored = handles[files[key]].get_slice(key)
        window = (_local_window(p, stored.get_shape())
                  if isinstance(p, DTensor) and not is_nf4(p) else None)
        if window is not None:
            local_tensor(p).copy_(stored[window])
        else:
            fill_from_full(p, stored[:].to(p.dtype))


def materialize(parts: list[nn.Module], device: torch.device,
                source: Callable[[], dict[str, torch.Tensor]], group=None) -> None:
    """Allocate ``parts`` (built on meta, already sharded) on ``device`` and fill them from the
    full state ``source()`` returns on the first rank of ``group`` (the model's ranks; default:
    the world), called there only. Collective: every rank of ``group``."""
    for part in parts:
        part.to_empty(device=device)
    rank0 = dist.get_rank(group) == 0
    full = source() if rank0 else None
    header = [{k: (tuple(v.shape), v.dtype) for k, v in full.items()} if rank0 else None,
              torch.get_rng_state() if rank0 else None]
    dist.broadcast_object_list(header, group=group, group_src=0)
    shapes, rng = header
    targets = _targets(parts)
    missing = sorted(set(targets) - set(shapes))
    if missing:
        raise ValueError(f"initial weights lack {', '.join(missing[:5])}: the model built on "
                         "the meta device and the one built on rank 0 differ")
    for key, (shape, dtype) in shapes.items():
        tensor = (full.pop(key).to(device) if rank0
                  else torch.empty(shape, dtype=dtype, device=device))
        dist.broadcast(tensor, group=group, group_src=0)
        for target in targets.get(key, ()):
            fill_from_full(target, tensor)
        del tensor
    torch.set_rng_state(rng)
