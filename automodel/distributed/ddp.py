"""DistributedDataParallel over the data-parallel mesh axis."""

from __future__ import annotations

import inspect

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from automodel.config.schema import DDPConfig
from automodel.distributed.mesh import MeshAxis
from automodel.peft.nf4 import is_nf4


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, opts: DDPConfig,
              device) -> DistributedDataParallel:
    kwargs = dict(
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=opts.find_unused_parameters,
        gradient_as_bucket_view=opts.gradient_as_bucket_view,
        static_graph=opts.static_graph,
        # QLoRA's NF4 weights: every rank holds rank 0's 4-bit values already (filled from
        # one source); DDP's first broadcast would copy dequantized values back into them,
        # which quantizes them a second time (other values)
        init_sync=not any(is_nf4(p) for p in model.parameters()),
    )
    # torch >= 2.13 calls broadcast_buffers forward_sync_buffers (the old name warns).
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = opts.broadcast_buffers
    else:
        kwargs["broadcast_buffers"] = opts.broadcast_buffers
    if opts.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = opts.bucket_cap_mb
    return DistributedDataParallel(model, **kwargs)


# --------------------------------------------------------------------------- strategy hooks
# ``parallelism=ddp`` (config/strategies.py) names these.
def wrap_ddp(part: nn.Module, blocks: list[str], setup, experts: list) -> DistributedDataParallel:
    """The data-parallel wrap of one model part (``setup``: the ``DistributedSetup``)."""
    return apply_ddp(part, setup.mesh[MeshAxis.DP], setup.options, setup.device)


def defer_ddp_sync(model: DistributedDataParallel, setup, is_last: bool):
    """``no_sync`` on all but the last micro-batch.

    Not under ``static_graph``: torch's reducer does not support ``no_sync`` there (the first
    backward fails an internal assert; past it, later steps stop reducing). Every
    micro-batch's backward reduces instead; each adds the average of its gradients to the
    already averaged sum of the earlier ones, so the result is the same."""
    if not is_last and not setup.options.static_graph:
        return model.no_sync()
    return None


def unused_parameter_hint(err: RuntimeError) -> RuntimeError:
    """A failed backward under DDP: the fix when parameters received no gradient."""
    text = str(err)
    if "Expected to have finished reduction" in text or "did not receive grad" in text:
        return RuntimeError("DDP found parameters that received no gradient (a branch of the "
                            "model was not used). Set parallelism.find_unused_parameters=true."
                            f"\n{text}")
    return err
