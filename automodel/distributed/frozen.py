"""Frozen modules under FSDP2 (``parallelism.multimodal.frozen_sharding``).

A module whose parameters are all frozen (``model.freeze``: typically an image-text model's
vision tower) needs no gradient reduction. The policies:

- ``root``: fully frozen blocks are not units of their own; their weights join the root unit,
  which every rank gathers at the start of every forward (nothing waits on a module some
  rank skips);
- ``per_layer``: every block is its own unit, frozen or not (the least memory: one block
  gathered at a time). Every rank must then run the tower in every micro-batch: image-text
  micro-batches without an image carry a placeholder image (``data/image_text.py``), so they
  do;
- ``replicate``: the fully frozen modules' weights are left out of FSDP2 (``ignored_params``):
  whole on every rank, never communicated.

A block with any trainable parameter is a unit of its own under every policy.
"""

from __future__ import annotations

from torch import nn


def _frozen(module: nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def plan_units(part: nn.Module, blocks: list[str], policy: str):
    """(the blocks to shard as units of their own, the parameters FSDP2 leaves alone)."""
    frozen_blocks = [b for b in blocks if _frozen(part.get_submodule(b))]
    units = blocks if policy == "per_layer" else [b for b in blocks if b not in frozen_blocks]
    ignored: set = set()
    if policy == "replicate":
        in_units = {id(p) for b in units for p in part.get_submodule(b).parameters()}
        for module in part.modules():  # frozen parameters outside the trainable units, whose
            own = list(module.parameters(recurse=False))  # own module is fully frozen
            if own and not any(p.requires_grad for p in own):
                ignored.update(p for p in own if id(p) not in in_units)
    return units, ignored
