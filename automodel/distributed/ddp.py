"""DistributedDataParallel over the data-parallel mesh axis."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from automodel.config.schema import DDPConfig


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, opts: DDPConfig, device) -> DistributedDataParallel:
    kwargs = dict(
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        # torch >= 2.13 names broadcast_buffers forward_sync_buffers; same behaviour.
        forward_sync_buffers=opts.broadcast_buffers,
        find_unused_parameters=opts.find_unused_parameters,
        gradient_as_bucket_view=opts.gradient_as_bucket_view,
        static_graph=opts.static_graph,
    )
    if opts.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = opts.bucket_cap_mb
    return DistributedDataParallel(model, **kwargs)
