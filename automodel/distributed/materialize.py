"""Meta-device construction: shard first, then allocate only this rank's slices and fill them.

Every rank builds the model on the meta device (no memory), and ``parallelize`` splits it into
stages and applies TP/FSDP2 there. Then ``materialize`` allocates this rank's shards on its
device (``to_empty``) and fills them from one full copy of the initial weights that rank 0
alone builds on the host (from config with the run's seed, or ``from_pretrained``): rank 0
broadcasts one tensor at a time and every rank keeps the slices its shards cover.

Why rank 0 broadcasting rather than each rank reading its slices of the safetensors files:
initial weights from config must be bit-identical to a single-process run of the same seed,
which only a full, sequential initialization gives; and a pretrained checkpoint may be in any
format ``from_pretrained`` understands (bin, safetensors, sharded, tied keys dropped). The cost
is one full copy in rank 0's host memory (the node's host holds at most one) and the model's
bytes broadcast once over the job; each accelerator holds one full tensor at a time.
Buffers (also the non-persistent ones, such as rotary frequencies) travel the same way, and
rank 0's random-number state after initialization is given to every rank, as if each had
built the model itself.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from automodel.config.schema import ModelConfig


def _targets(parts: list[nn.Module]) -> dict[str, list[torch.Tensor]]:
    """Every parameter and buffer of this rank's parts by its (unsplit) name; tied weights and
    a weight held by two parts appear under each of their names."""
    out: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for name, t in [*part.named_parameters(remove_duplicate=False),
                        *part.named_buffers(remove_duplicate=False)]:
            out.setdefault(_clean(name), []).append(t)
    return out


def _clean(name: str) -> str:
    """Names as the unwrapped model has them (activation checkpointing wraps blocks)."""
    return name.replace("_checkpoint_wrapped_module.", "")


@torch.no_grad()
def _fill(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        piece = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target._local_tensor.copy_(piece._local_tensor)
    else:
        target.copy_(full)


def full_initial_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The whole model's initial parameters and buffers, on the host (rank 0 only)."""
    from automodel.models.builder import build_model

    model = build_model(cfg, seed)
    return {**model.state_dict(), **dict(model.named_buffers())}


def materialize(parts: list[nn.Module], device: torch.device,
                source: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Allocate ``parts`` (built on meta, already sharded) on ``device`` and fill them from the
    full state ``source()`` returns on rank 0 (called there only). Collective: every rank."""
    for part in parts:
        part.to_empty(device=device)
    rank0 = dist.get_rank() == 0
    full = source() if rank0 else None
    header = [{k: (tuple(v.shape), v.dtype) for k, v in full.items()} if rank0 else None,
              torch.get_rng_state() if rank0 else None]
    dist.broadcast_object_list(header, src=0)
    shapes, rng = header
    targets = _targets(parts)
    missing = sorted(set(targets) - set(shapes))
    if missing:
        raise ValueError(f"initial weights lack {', '.join(missing[:5])}: the model built on "
                         "the meta device and the one built on rank 0 differ")
    for key, (shape, dtype) in shapes.items():
        tensor = (full.pop(key).to(device) if rank0
                  else torch.empty(shape, dtype=dtype, device=device))
        dist.broadcast(tensor, src=0)
        for target in targets.get(key, ()):
            _fill(target, tensor)
        del tensor
    torch.set_rng_state(rng)
