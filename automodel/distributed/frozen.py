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
  whole on every rank, never communicated. FSDP2's mixed precision does not reach them, so
  ``compute_in_param_dtype`` gives them the same compute dtype as the sharded weights
  (``mp_policy.param_dtype``): all three policies compute the same numbers.

A block with any trainable parameter is a unit of its own under every policy.
"""

from __future__ import annotations

import torch
from torch import nn

from automodel.compat import checkpoint_wrapper_api, get_parameter, set_parameter

ActivationWrapper = checkpoint_wrapper_api().ActivationWrapper


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


def compute_in_param_dtype(part: nn.Module, ignored: set, dtype) -> list[nn.Module]:
    """``replicate`` under mixed precision: the replicated frozen weights run in ``dtype``.

    At the outermost modules that hold only replicated weights (a frozen vision tower, a frozen
    block; the boundary FSDP2 would cast at), copies in ``dtype`` take the parameters' places
    for the module's forward and the originals return after it: the state dict, checkpoints
    and the export keep the stored dtype, and autograd keeps the copies a backward needs (as
    FSDP2 keeps its unsharded parameters). Returns the modules that swap."""
    ids = {id(p) for p in ignored if p.is_floating_point() and p.dtype != dtype}
    if dtype is None or not ids:
        return []
    # by owner and name: materializing a meta model replaces the parameter objects later
    names = {id(m): [n for n, p in m.named_parameters(recurse=False) if id(p) in ids]
             for m in part.modules()}
    swapping = []
    for module, recurse in _swap_units(part, ids):
        owners = list(module.modules()) if recurse else [module]
        _swap_during_forward(module, dtype, [(o, n) for o in owners for n in names[id(o)]])
        swapping.append(module)
    return swapping


def _swap_units(module: nn.Module, ids: set, found=None) -> list:
    """(module, whole subtree?) pairs: outermost callable modules all of whose parameters are
    in ``ids``; else a module's own such parameters, and the same search in its children.
    Containers without a forward (ModuleList) and checkpoint wrappers (whose recompute calls
    the wrapped module) are looked through."""
    found = [] if found is None else found
    params = list(module.parameters())
    looked_through = (type(module).forward is nn.Module.forward
                      or isinstance(module, ActivationWrapper))
    if params and all(id(p) in ids for p in params) and not looked_through:
        found.append((module, True))
        return found
    if any(id(p) in ids for p in module.parameters(recurse=False)):
        found.append((module, False))
    for child in module.children():
        _swap_units(child, ids, found)
    return found


def _swap_during_forward(module: nn.Module, dtype: torch.dtype, slots: list) -> None:
    """``slots``: (owner module, parameter name) of the weights to swap."""
    originals: list = []  # (owner, name, parameter) of the call in flight

    def swap_in(mod, args):
        copies: dict = {}  # one copy per parameter (tied weights stay tied)
        for owner, name in slots:
            p = get_parameter(owner, name)
            if p.dtype == dtype:  # (swapped already: a nested call)
                continue
            if id(p) not in copies:
                copies[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            originals.append((owner, name, p))
            set_parameter(owner, name, copies[id(p)])

    def swap_out(mod, args, output):
        while originals:
            owner, name, p = originals.pop()
            set_parameter(owner, name, p)

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_out, always_call=True)
