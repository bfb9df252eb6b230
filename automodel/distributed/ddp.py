"""DistributedDataParallel over the data-parallel mesh axis."""

from __future__ import annotations

import inspect

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from automodel.config.schema import DDPConfig


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, opts: DDPConfig,
              device) -> DistributedDataParallel:
    kwargs = dict(
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=opts.find_unused_parameters,
        gradient_as_bucket_view=opts.gradient_as_bucket_view,
        static_graph=opts.static_graph,
    )
    # torch >= 2.13 calls broadcast_buffers forward_sync_buffers (the old name warns).
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = opts.broadcast_buffers
    else:
        kwargs["broadcast_buffers"] = opts.broadcast_buffers
    if opts.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = opts.bucket_cap_mb
    return DistributedDataParallel(model, **kwargs)
