"""The device mesh: named axes, flattened views, and sizes read back from the live mesh.

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

from automodel.distributed.patches import building_mesh_outside_this_rank


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


BASE_AXES = (MeshAxis.PP, MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.CP_RING,
             MeshAxis.CP_ULYSSES, MeshAxis.TP)
_CP = (MeshAxis.CP_RING, MeshAxis.CP_ULYSSES)
FLATTENED = {
    MeshAxis.DP: (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD),
    MeshAxis.CP: _CP,
    MeshAxis.DP_SHARD_CP: (MeshAxis.DP_SHARD, *_CP),
    MeshAxis.DP_CP: (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, *_CP),
}


def _options(backend: str, timeout: datetime.timedelta) -> tuple:
    """(backend, options carrying the timeout), so every sub-group gets it (not torch's
    30 min)."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return (backend, None)
    opts._timeout = timeout
    return (backend, opts)


class MeshContext:
    """Owns the DeviceMesh and its flattened views. Sizes come from the mesh itself."""

    def __init__(self, device_mesh: DeviceMesh, flattened: dict,
                 moe: DeviceMesh | None = None, group=None):
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
    """``cp`` ranks per sequence: ``cp / cp_ulysses`` ring ranks x ``cp_ulysses`` Ulysses
    ranks (a Ulysses group is contiguous: its all-to-all stays within a node first).

    ``ranks``: the global ranks holding the model, in mesh order (default: all). Collective
    over the whole job, as torch creates process groups: a job with several models has every
    rank build every model's mesh, in the same order; a rank outside ``ranks`` just does not
    use it."""
    cp_ring = cp // cp_ulysses
    timeout = datetime.timedelta(minutes=timeout_minutes)
    sizes = {MeshAxis.PP: pp, MeshAxis.DP_REPLICATE: dp_replicate, MeshAxis.DP_SHARD: dp_shard,
             MeshAxis.CP_RING: cp_ring, MeshAxis.CP_ULYSSES: cp_ulysses, MeshAxis.TP: tp}
    world = dist.get_world_size()
    ranks = list(range(world) if ranks is None else ranks)
    needed = pp * dp_replicate * dp_shard * cp_ring * cp_ulysses * tp
    if len(ranks) != needed:
        raise ValueError(f"the mesh (pp x dp_replicate x dp_shard x cp x tp) needs {needed} "
                         f"ranks; got {len(ranks)}: {ranks}")
    outside = dist.get_rank() not in ranks  # (it takes part in creating the groups)
    with building_mesh_outside_this_rank() if outside else contextlib.nullcontext():
        mesh, flattened, moe = _device_meshes(device_type, _options(backend, timeout), sizes,
                                              torch.tensor(ranks, dtype=torch.int), ep)
    group = None  # the whole world: the default group serves
    if sorted(ranks) != list(range(world)):
        group = dist.new_group(ranks, timeout=timeout, backend=backend,
                               pg_options=_options(backend, timeout)[1], group_desc="model")
    return MeshContext(mesh, flattened, moe, group)


def _device_meshes(device_type: str, opts: tuple, sizes: dict, ranks: torch.Tensor, ep: int):
    """(the mesh, its flattened views, the MoE mesh or None) over ``ranks``."""
    mesh = DeviceMesh(device_type, ranks.reshape([sizes[a] for a in BASE_AXES]),
                      mesh_dim_names=tuple(a.value for a in BASE_AXES),
                      backend_override=(opts,) * len(BASE_AXES))
    flattened = {name: mesh[tuple(a.value for a in parts)]._flatten(name.value,
                                                                    backend_override=opts)
                 for name, parts in FLATTENED.items()}
    moe = None
    if ep > 1:  # the dp x cp x tp ranks of each stage regrouped as ep_shard x ep
        pp = sizes[MeshAxis.PP]
        per_stage = ranks.numel() // pp
        # ep_unit (size 1): the shard dim of an (ep_shard, ep_unit) mesh that replicates the
        # experts over ep_shard instead of sharding them (parallelism.moe.shard_experts=false)
        names = ("pp", "ep_shard", "ep_unit", "ep")
        moe = DeviceMesh(device_type, ranks.reshape(pp, per_stage // ep, 1, ep),
                         mesh_dim_names=names, backend_override=(opts,) * len(names))
    return mesh, flattened, moe
