"""FSDP2 (``fully_shard``): per transformer block, then the root; HSDP on a 2-D mesh."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from automodel.compat import keep_output_recording
from automodel.config.policies import POLICY_FIELDS, PolicySpec
from automodel.config.schema import FSDP2Config
from automodel.distributed.frozen import compute_in_param_dtype, plan_units
from automodel.models.parts import group_of, vision_tower

log = logging.getLogger(__name__)
_CLASSES = {"MixedPrecisionPolicy": MixedPrecisionPolicy, "CPUOffloadPolicy": CPUOffloadPolicy,
            "OffloadPolicy": OffloadPolicy}


def build_policy(spec: PolicySpec | None, device: torch.device):
    """The torch policy object for a validated spec (dtype names become torch dtypes)."""
    if spec is None:
        return None
    kwargs = {}
    for key, value in spec.kwargs.items():
        kind = POLICY_FIELDS[spec.name][key]
        kwargs[key] = getattr(torch, value) if (kind == "dtype" and value is not None) else value
    if (spec.name == "CPUOffloadPolicy" and device.type == "cpu"
            and not torch.accelerator.is_available()):
        if kwargs.get("pin_memory", True):
            log.info("offload_policy: pin_memory=False (pinned memory needs an accelerator)")
        kwargs["pin_memory"] = False
    return _CLASSES[spec.name](**kwargs)


def reshard_after_forward_for(index: int, num_blocks: int, opts: FSDP2Config,
                              pp_enabled: bool) -> bool:
    """options.md: explicit value wins; else no reshard under PP, else all blocks but the last."""
    if opts.reshard_after_forward is not None:
        return opts.reshard_after_forward
    if pp_enabled:
        return False
    return index < num_blocks - 1


def apply_fsdp2(model: nn.Module, block_fqns: list[str], mesh: DeviceMesh, opts: FSDP2Config,
                mp_policy: MixedPrecisionPolicy, offload_policy,
                pp_enabled: bool = False, experts=None) -> list[nn.Module]:
    """Shard every block, then the root. Returns the sharded blocks in forward order.

    ``experts`` (expert parallelism): (experts modules, their mesh); each is sharded on its
    own, before its block, over that mesh (``parallelism.moe`` sets how)."""
    common = {"mesh": mesh, "mp_policy": mp_policy,
              "offload_policy": offload_policy or OffloadPolicy()}
    expert_modules, expert_mesh = experts or ([], None)
    vision = opts.multimodal.vision
    if vision.unit == "tower":
        block_fqns = tower_as_one_unit(model, block_fqns)
    block_fqns, ignored = plan_units(model, block_fqns, opts.multimodal.frozen_sharding)
    if ignored:
        common["ignored_params"] = ignored
        compute_in_param_dtype(model, ignored, mp_policy.param_dtype if mp_policy else None)
    blocks = []
    for i, fqn in enumerate(block_fqns):
        block = model.get_submodule(fqn)
        reshard = reshard_after_forward_for(i, len(block_fqns), opts, pp_enabled)
        if vision.reshard_after_forward is not None and group_of(fqn) == "vision":
            reshard = vision.reshard_after_forward
        for module in expert_modules:
            if any(m is module for m in block.modules()):
                own = opts.moe.reshard_after_forward
                fully_shard(module, reshard_after_forward=reshard if own is None else own,
                            **{**common, "mesh": expert_mesh})
        for module in own_dtype_modules(block, expert_modules):
            fully_shard(module, reshard_after_forward=reshard, **common)
        original = type(block)
        fully_shard(block, reshard_after_forward=reshard, **common)
        keep_output_recording(block, original)  # (a whole tower is a transformers model)
        blocks.append(block)
    # The root (embeddings, final norm, head; under frozen_sharding=root a frozen tower) is
    # kept gathered from forward into backward: its head runs first in backward, so
    # resharding it after forward would only gather it again at once (and the fused loss
    # applies the head after the model's forward).
    root_reshard = False if pp_enabled else None  # None: FSDP2's choice for a root: keep it
    fully_shard(model, reshard_after_forward=root_reshard, **common)
    if opts.enable_fsdp2_prefetch:
        set_prefetch(blocks, opts.fsdp2_forward_prefetch_depth, opts.fsdp2_backward_prefetch_depth)
    return blocks


def own_dtype_modules(block: nn.Module, skip=()) -> list[nn.Module]:
    """Modules of ``block`` whose trainable parameters keep a dtype other than the block's
    (a router kept in float32 among bfloat16 weights: DeepSeek-V3's ``gate``): FSDP2 needs
    one dtype per unit, so each becomes a unit of its own (outermost ones; not inside
    ``skip``, the experts sharded apart)."""
    sizes: dict = {}
    for p in block.parameters():
        if p.requires_grad:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return []
    main = max(sizes, key=sizes.get)
    inside = [m for s in skip for m in s.modules()]
    found: list[nn.Module] = []
    for _, module in block.named_modules():
        own = [p for p in module.parameters() if p.requires_grad]
        if (module is block or not own or any(p.dtype == main for p in own)
                or any(module is m for m in inside)
                or any(module is m for f in found for m in f.modules())):
            continue
        found.append(module)
    return found


def tower_as_one_unit(model: nn.Module, block_fqns: list[str]) -> list[str]:
    """``multimodal.vision.unit=tower``: the vision blocks replaced by their tower, in the
    place of the first (one all-gather for the whole tower instead of one per block)."""
    tower = vision_tower(model)
    if tower is None:
        return block_fqns
    inside = [f for f in block_fqns if f.startswith(tower + ".")]
    if not inside:
        return block_fqns
    first = block_fqns.index(inside[0])
    rest = [f for f in block_fqns if f not in inside]
    return rest[:first] + [tower] + rest[first:]


def set_prefetch(blocks: list[nn.Module], forward_depth: int, backward_depth: int) -> None:
    """Explicit prefetch chains: in forward each block all-gathers the next ``forward_depth``;
    in backward each block all-gathers the ``backward_depth`` blocks before it that run a
    backward (fully frozen blocks, such as a frozen vision tower, do not)."""
    for i, block in enumerate(blocks):
        nxt = blocks[i + 1:i + 1 + forward_depth]
        if nxt and forward_depth > 0:
            block.set_modules_to_forward_prefetch(nxt)
    trained = [b for b in blocks if any(p.requires_grad for p in b.parameters())]
    for i, block in enumerate(trained):
        prev = list(reversed(trained[max(0, i - backward_depth):i]))
        if prev and backward_depth > 0:
            block.set_modules_to_backward_prefetch(prev)


# --------------------------------------------------------------------------- strategy hooks
# ``parallelism=fsdp2`` and ``hsdp`` (config/strategies.py) name these.
def wrap_fsdp2(part: nn.Module, blocks: list[str], setup, experts: list) -> nn.Module:
    """The data-parallel wrap of one model part (``setup``: the ``DistributedSetup``): FSDP2
    over the mesh's data-parallel (x context-parallel) ranks; the experts of expert
    parallelism on their own FSDP2 mesh, sharded over ``ep_shard`` or replicated."""
    moe = None
    if experts:
        dims = "ep_shard" if setup.options.moe.shard_experts else ("ep_shard", "ep_unit")
        moe = (experts, setup.mesh.moe[dims])
    apply_fsdp2(part, blocks, setup.mesh.fsdp_mesh(), setup.options,
                build_policy(setup.mp_policy, setup.device),
                build_policy(setup.offload_policy, setup.device), setup.pp_enabled, moe)
    return part


def defer_fsdp2_sync(model: nn.Module, setup, is_last: bool):
    """``defer_fsdp_grad_sync``: reduce-scatter only in the last micro-batch's backward."""
    if setup.options.defer_fsdp_grad_sync:
        model.set_requires_gradient_sync(is_last)
    return None
