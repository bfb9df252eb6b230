"""The device mesh: named axes, flattened views, and sizes read back from the live mesh.

Its shape, its flattened views and the MoE regrouping are the ``Layout``'s
(``automodel/config/layout.py``, torch-free): this module only turns them into process groups.

The mesh covers exactly the ranks that hold the model: every rank of the job by default, or
the ``ranks`` given to ``build_mesh`` when the job holds other models on other ranks (a frozen
reference model, a teacher). ``MeshContext.group`` spans those ranks: the recipe's own
collectives (the per-step read, barriers, checkpoints) use it, never the world group.
"""

from __future__ import annotations

import contextlib
import datetime
from enum import Enum
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from automodel.compat import (
    building_mesh_outside_this_rank,
    flatten_mesh,
    new_gloo_options,
    set_options_timeout,
)
from automodel.config import layout as layout_axes
from automodel.config.layout import Layout


class MeshAxis(str, Enum):
    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP_RING = "cp_ring"  # context parallel: ranks exchanging K/V around a ring
    CP_ULYSSES = "cp_ulysses"  # context parallel: ranks trading sequence for heads
    TP = "tp"
    # flattened views
    CP = "cp"  # cp_ring x cp_ulysses: ranks holding parts of the same sequences
    DP = "dp"  # dp_replicate x dp_shard: ranks that see different data
    DP_SHARD_CP = "dp_shard_cp"  # FSDP shards parameters over these
    DP_CP = "dp_cp"  # gradients/loss are averaged over these


BASE_AXES = tuple(MeshAxis(a) for a in layout_axes.BASE_AXES)
FLATTENED = {MeshAxis(name): tuple(MeshAxis(a) for a in parts)
             for name, parts in layout_axes.FLATTENED.items()}


def _options(backend: str, timeout: datetime.timedelta) -> tuple:
    """(backend, options carrying the timeout), so every sub-group gets it (not torch's
    30 min)."""
    if backend == "gloo":
        opts = new_gloo_options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return (backend, None)
    set_options_timeout(opts, timeout)
    return (backend, opts)


class MeshContext:
    """Owns the DeviceMesh and its flattened views. Sizes come from the mesh itself."""

    def __init__(self, layout: Layout, device_mesh: DeviceMesh, flattened: dict,
                 moe: DeviceMesh | None = None, group=None):
        self.layout = layout  # the degrees it was built from
        self.device_mesh = device_mesh
        self._flattened = flattened
        self.moe = moe  # (pp, ep_shard, ep_unit, ep): the MoE mesh under expert parallelism
        self._group = group  # None: the mesh spans the world

    @property
    def group(self):
        """The model-local process group: every rank of the mesh, and no other."""
        return dist.group.WORLD if self._group is None else self._group

    def __getitem__(self, axis: MeshAxis) -> DeviceMesh:
        axis = MeshAxis(axis)
        if axis in self._flattened:
            return self._flattened[axis]
        return self.device_mesh[axis.value]

    def size(self, axis: MeshAxis) -> int:
        return self[axis].size()

    def local_rank(self, axis: MeshAxis) -> int:
        return self[axis].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.size(MeshAxis.DP)

    @property
    def dp_rank(self) -> int:
        return self.local_rank(MeshAxis.DP)

    @property
    def dp_replicate_size(self) -> int:
        return self.size(MeshAxis.DP_REPLICATE)

    def fsdp_mesh(self) -> DeviceMesh:
        """1-D shard mesh, or the 2-D (replicate, shard) mesh for HSDP. Parameters are
        sharded over the cp ranks too: they hold different tokens of the same samples, so
        their gradients are reduced like those of data-parallel ranks."""
        if self.dp_replicate_size > 1:
            return self.device_mesh[(MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD_CP.value)]
        return self[MeshAxis.DP_SHARD_CP]


def build_mesh(device_type: str, backend: str, timeout_minutes: int, *, pp: int,
               dp_replicate: int, dp_shard: int, cp: int, tp: int,
               cp_ulysses: int = 1, ep: int = 1,
               ranks: Optional[Sequence[int]] = None) -> MeshContext:
    """``build_mesh_for`` the ``Layout`` of these degrees."""
    layout = Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp,
                    cp_ulysses=cp_ulysses, tp=tp, ep=ep)
    return build_mesh_for(layout, device_type, backend, timeout_minutes, ranks)


def build_mesh_for(layout: Layout, device_type: str, backend: str, timeout_minutes: float,
                   ranks: Optional[Sequence[int]] = None) -> MeshContext:
    """The mesh of ``layout``: ``cp`` ranks per sequence are ``cp_ring`` ring ranks x
    ``cp_ulysses`` Ulysses ranks (a Ulysses group is contiguous: its all-to-all stays within a
    node first).

    ``ranks``: the global ranks holding the model, in mesh order (default: all). Collective
    over the whole job, as torch creates process groups: a job with several models has every
    rank build every model's mesh, in the same order; a rank outside ``ranks`` just does not
    use it."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    world = dist.get_world_size()
    ranks = list(range(world) if ranks is None else ranks)
    if len(ranks) != layout.world_size:
        raise ValueError(f"the mesh (pp x dp_replicate x dp_shard x cp x tp) needs "
                         f"{layout.world_size} ranks; got {len(ranks)}: {ranks}")
    outside = dist.get_rank() not in ranks  # (it takes part in creating the groups)
    with building_mesh_outside_this_rank() if outside else contextlib.nullcontext():
        mesh, flattened, moe = _device_meshes(device_type, _options(backend, timeout), layout,
                                              torch.tensor(ranks, dtype=torch.int))
    group = None  # the whole world: the default group serves
    if sorted(ranks) != list(range(world)):
        group = dist.new_group(ranks, timeout=timeout, backend=backend,
                               pg_options=_options(backend, timeout)[1], group_desc="model")
    return MeshContext(layout, mesh, flattened, moe, group)


def _device_meshes(device_type: str, opts: tuple, layout: Layout, ranks: torch.Tensor):
    """(the mesh, its flattened views, the MoE mesh or None) over ``ranks``."""
    mesh = DeviceMesh(device_type, ranks.reshape(layout.shape),
                      mesh_dim_names=tuple(a.value for a in BASE_AXES),
                      backend_override=(opts,) * len(BASE_AXES))
    flattened = {name: flatten_mesh(mesh[tuple(a.value for a in parts)], name.value, opts)
                 for name, parts in FLATTENED.items()}
    moe = None
    if layout.ep_enabled:  # the dp x cp x tp ranks of each stage regrouped as ep_shard x ep
        names = layout_axes.MOE_AXES
        moe = DeviceMesh(device_type, ranks.reshape(layout.moe_shape),
                         mesh_dim_names=names, backend_override=(opts,) * len(names))
    return mesh, flattened, moe
