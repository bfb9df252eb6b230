"""The device mesh: named axes, flattened views, and sizes read back from the live mesh."""

from __future__ import annotations

import datetime
from enum import Enum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


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


def _options(backend: str, timeout: datetime.timedelta):
    """Backend options carrying the timeout, so every sub-group gets it (not torch's 30 min)."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return backend
    opts._timeout = timeout
    return (backend, opts)


class MeshContext:
    """Owns the DeviceMesh and its flattened views. Sizes come from the mesh itself."""

    def __init__(self, device_mesh: DeviceMesh, flattened: dict,
                 moe: DeviceMesh | None = None):
        self.device_mesh = device_mesh
        self._flattened = flattened
        self.moe = moe  # (pp, ep_shard, ep_unit, ep): the MoE mesh under expert parallelism

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
               cp_ulysses: int = 1, ep: int = 1) -> MeshContext:
    """``cp`` ranks per sequence: ``cp / cp_ulysses`` ring ranks x ``cp_ulysses`` Ulysses
    ranks (a Ulysses group is contiguous: its all-to-all stays within a node first)."""
    cp_ring = cp // cp_ulysses
    timeout = datetime.timedelta(minutes=timeout_minutes)
    sizes = {MeshAxis.PP: pp, MeshAxis.DP_REPLICATE: dp_replicate, MeshAxis.DP_SHARD: dp_shard,
             MeshAxis.CP_RING: cp_ring, MeshAxis.CP_ULYSSES: cp_ulysses, MeshAxis.TP: tp}
    assert dist.get_world_size() == pp * dp_replicate * dp_shard * cp_ring * cp_ulysses * tp, (
        "resolve.py guarantees the mesh matches the world size")
    opts = _options(backend, timeout)
    mesh = init_device_mesh(device_type, tuple(sizes[a] for a in BASE_AXES),
                            mesh_dim_names=tuple(a.value for a in BASE_AXES),
                            backend_override={a.value: opts for a in BASE_AXES})
    flattened = {name: mesh[tuple(a.value for a in parts)]._flatten(name.value,
                                                                    backend_override=opts)
                 for name, parts in FLATTENED.items()}
    moe = None
    if ep > 1:  # the dp x cp x tp ranks of each stage regrouped as ep_shard x ep
        per_stage = dp_replicate * dp_shard * cp * tp
        # ep_unit (size 1): the shard dim of an (ep_shard, ep_unit) mesh that replicates the
        # experts over ep_shard instead of sharding them (parallelism.moe.shard_experts=false)
        names = ("pp", "ep_shard", "ep_unit", "ep")
        moe = init_device_mesh(device_type, (pp, per_stage // ep, 1, ep), mesh_dim_names=names,
                               backend_override={n: opts for n in names})
    return MeshContext(mesh, flattened, moe)
