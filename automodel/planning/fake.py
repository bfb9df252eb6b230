"""What the planner's fake mode needs beyond torch's ``FakeTensorMode``.

- ``RealStaysReal``: an op whose tensor inputs are all real host tensors, or all meta
  tensors, runs for real. The mesh's own index arithmetic (``DeviceMesh`` finds a rank's
  coordinates with ``nonzero`` on its rank tensor, e.g. when FSDP2 joins a TP mesh) and the
  batch's token counting then work as in a real run, and ``parallelize`` splits and shards
  the meta model's parameters on the meta device, as a real run does before it materializes
  them; everything that touches a materialized parameter or an activation stays fake. Factory
  ops (no tensor input) stay fake, so nothing large is ever allocated.
- ``IndicesStayReal``: while the planner's measured step runs, an op on real host tensors of
  integers or booleans only runs for real: the small image metadata a family reads on the
  host (LLaVA-NeXT's ``image_sizes``, which a real GPU run copies back with ``tolist``) keeps
  its values, where a fake copy would have none. Token ids and masks stay real too (a few
  bytes a token: no memory the plan counts). Not in the preflight's fake step: a family
  that builds new tensors from such values (Qwen2-VL's rotary positions) would mix real and
  fake there; the planner refuses those families before simulating them.
- ``allocate_fake``: ``parallelize``'s materialization: every parameter and buffer of the parts
  gets fake storage of its shape, dtype and placement; tied weights stay tied.
- ``ModuleTrail``: which module of the parts was running when a step failed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from automodel.compat import (
    direct_buffers,
    direct_parameters,
    dispatch_mode_base,
    set_buffer,
    set_parameter,
    tensor_leaves,
)
from automodel.compat.planning import is_fake, real_tensors
from automodel.peft.nf4 import allocate_whole, is_nf4


def _device_if_real(t: torch.Tensor) -> str | None:
    """"cpu" or "meta" for a plain (not fake) host or meta tensor; None otherwise."""
    if type(t) in (torch.Tensor, nn.Parameter) and not is_fake(t):
        return t.device.type if t.device.type in ("cpu", "meta") else None
    return None


class RealStaysReal(dispatch_mode_base()):
    """Enter after ``FakeTensorMode``: ops on real tensors only run for real (on host tensors
    only, or on meta tensors only: the meta model's parameters, which ``parallelize`` splits
    and shards before they are materialized, as in a real run; torch's meta kernels give the
    same shapes as the fake mode would, without the fake mode's cost per output, which
    FSDP2 pays for every shard of every parameter: a dp_shard of 256 made that most of
    the simulation)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tensor_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tensors and self.runs_real(tensors):
            with real_tensors():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def runs_real(tensors: list) -> bool:
        devices = {_device_if_real(t) for t in tensors}
        return len(devices) == 1 and None not in devices


class IndicesStayReal(RealStaysReal):
    """Enter innermost, around a simulated step: an op whose tensor inputs are all real host
    tensors of an integer or boolean dtype runs for real (see the module's note)."""

    @staticmethod
    def runs_real(tensors: list) -> bool:
        return all(_device_if_real(t) == "cpu" and not t.is_floating_point()
                   and not t.is_complex() for t in tensors)


def allocate_fake(parts: list) -> None:
    """Fake storage for every parameter and buffer of ``parts`` (built on the meta device)."""
    from torch.distributed.fsdp import FSDPModule


    made: dict = {}
    for part in parts:
        if any(isinstance(m, FSDPModule) for m in part.modules()):
            part.to_empty(device="cpu")  # (FSDP2 re-makes its sharded parameters)
            allocate_whole([part])
            continue
        for module in part.modules():
            for name, p in direct_parameters(module):
                if p is not None and p.device.type == "meta":
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(_empty(p), requires_grad=p.requires_grad)
                    set_parameter(module, name, made[id(p)])
            for name, b in direct_buffers(module):
                if b is not None and b.device.type == "meta":
                    made.setdefault(id(b), _empty(b))
                    set_buffer(module, name, made[id(b)])
        allocate_whole([part])


def _empty(t: torch.Tensor) -> torch.Tensor:
    """A fake host tensor of ``t``'s shape (made from no tensor: a plain meta ``t`` would
    make a real one under ``RealStaysReal``)."""
    if is_nf4(t):  # (QLoRA's 4-bit weight: its inner tensors; allocate_whole completes it)
        return torch.empty_like(t, device="cpu")
    if isinstance(t, DTensor):
        local = t.to_local()
        return DTensor.from_local(torch.empty(local.shape, dtype=local.dtype, device="cpu"),
                                  t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


class ModuleFailed(RuntimeError):
    """A step failed inside a module's forward: ``module`` is its name in the model
    (innermost first), ``error`` what it raised."""

    def __init__(self, module: str, error: BaseException):
        super().__init__(f"in {module}: {type(error).__name__}: {error}")
        self.module, self.error = module, error


class ModuleTrail:
    """Inside, the modules of ``parts`` whose forward is running are followed (global module
    hooks); an exception raised inside one leaves as ``ModuleFailed`` naming the innermost."""

    def __init__(self, parts: list):
        self._names = {id(m): n or f"{type(m).__name__}'s own forward" for part in parts
                       for n, m in part.named_modules()}
        self._running: list = []
        self._failed: str | None = None
        self._handles: list = []

    def _enter(self, module, args):
        self._running.append(self._names.get(id(module)))

    def _leave(self, module, args, output):
        self._running.pop()

    def __enter__(self):
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._handles = [register_module_forward_pre_hook(self._enter),
                         register_module_forward_hook(self._leave)]
        return self

    def __exit__(self, kind, error, tb):
        for h in self._handles:
            h.remove()
        inner = next((n for n in reversed(self._running) if n), None)
        if error is not None and isinstance(error, Exception) and inner is not None:
            raise ModuleFailed(inner, error) from error
        return False
