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
    CP = "cp"
    TP = "tp"
    # flattened views
    DP = "dp"  # dp_replicate x dp_shard: ranks that see different data
    DP_SHARD_CP = "dp_shard_cp"  # FSDP shards parameters over these
    DP_CP = "dp_cp"  # gradients/loss are averaged over these


BASE_AXES = (MeshAxis.PP, MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.CP, MeshAxis.TP)
FLATTENED = {
    MeshAxis.DP: (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD),
    MeshAxis.DP_SHARD_CP: (MeshAxis.DP_SHARD, MeshAxis.CP),
    MeshAxis.DP_CP: (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.CP),
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

    def __init__(self, device_mesh: DeviceMesh, flattened: dict):
        self.device_mesh = device_mesh
        self._flattened = flattened

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
        """1-D shard mesh, or the 2-D (replicate, shard) mesh for HSDP."""
        if self.dp_replicate_size > 1:
            return self.device_mesh[(MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)]
        return self[MeshAxis.DP_SHARD_CP]


def build_mesh(device_type: str, backend: str, timeout_minutes: int, *, pp: int,
               dp_replicate: int, dp_shard: int, cp: int, tp: int) -> MeshContext:
    timeout = datetime.timedelta(minutes=timeout_minutes)
    sizes = {MeshAxis.PP: pp, MeshAxis.DP_REPLICATE: dp_replicate, MeshAxis.DP_SHARD: dp_shard,
             MeshAxis.CP: cp, MeshAxis.TP: tp}
    assert dist.get_world_size() == pp * dp_replicate * dp_shard * cp * tp, (
        "resolve.py guarantees the mesh matches the world size")
    opts = _options(backend, timeout)
    mesh = init_device_mesh(device_type, tuple(sizes[a] for a in BASE_AXES),
                            mesh_dim_names=tuple(a.value for a in BASE_AXES),
                            backend_override={a.value: opts for a in BASE_AXES})
    flattened = {name: mesh[tuple(a.value for a in parts)]._flatten(name.value,
                                                                    backend_override=opts)
                 for name, parts in FLATTENED.items()}
    return MeshContext(mesh, flattened)
