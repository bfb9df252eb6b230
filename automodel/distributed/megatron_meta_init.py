"""Megatron-FSDP's meta-device initialization (``init_fsdp_with_meta_device=true``).

The model stays on the meta device up to the wrap: nothing is allocated before it. The
library then allocates one module at a time (``to_empty(recurse=False)``) and calls its
``reset_parameters``; ``prepare_meta_init`` points that method at the run's initial weights
(``ModuleSource``), so each rank ends with exactly the weights a one-process run starts from.
"""

from __future__ import annotations

import functools

from automodel.compat import direct_buffers, set_buffer, unwrapped_name


def materialize_part(part, fill, setup) -> None:
    """``parallelism=megatron_fsdp``'s ``materialize`` hook (config/strategies.py): with
    ``init_fsdp_with_meta_device`` megatron-fsdp itself allocates the part at the wrap, one
    module at a time (``prepare_meta_init``); else ``fill`` allocates and fills it now."""
    if setup.options.init_fsdp_with_meta_device:
        prepare_meta_init(part, fill, setup.device)
    else:
        fill([part])


def _clean(name: str) -> str:
    return unwrapped_name(name)


class ModuleSource:
    """The run's initial weights, one module at a time, for megatron-fsdp's meta-device
    initialization: read from a pretrained safetensors checkpoint by every rank (``files``),
    or else broadcast tensor by tensor from the first rank of ``group``, which builds the
    full state once (``full_state()``, on the host, as ``materialize`` does for FSDP2).
    Collective in the second case: every rank fills the same modules in the same order (the
    library visits its parameter groups in one order everywhere)."""

    def __init__(self, files, full_state, seed: int, group=None):
        self.files, self.full_state, self.seed, self.group = files, full_state, seed, group
        self.header = None  # {name: (shape, dtype)} from the first rank, on first use
        self.full = None
        self.handles: dict = {}

    def _start(self) -> None:
        import torch
        import torch.distributed as dist

        rank0 = dist.get_rank(self.group) == 0
        self.full = self.full_state() if rank0 else None
        box = [{k: (tuple(v.shape), v.dtype) for k, v in self.full.items()} if rank0 else None,
               torch.get_rng_state() if rank0 else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        self.header = box[0]
        torch.set_rng_state(box[1])  # as if every rank had built the model itself

    def tensor(self, key: str, device):
        """The full initial value of parameter ``key`` on ``device``."""
        import torch
        import torch.distributed as dist

        if self.files is not None:
            if not self.handles:
                torch.manual_seed(self.seed)  # (as build_model leaves it; no fill draws)
            if key not in self.files:
                raise ValueError(f"the checkpoint has no tensor {key!r}")
            if self.files[key] not in self.handles:
                from safetensors import safe_open

                self.handles[self.files[key]] = safe_open(self.files[key], framework="pt")
            return self.handles[self.files[key]].get_tensor(key).to(device)
        if self.header is None:
            self._start()
        if key not in self.header:
            raise ValueError(f"initial weights lack {key}: the model built on the meta device "
                             "and the one built on the first rank differ")
        shape, dtype = self.header[key]
        rank0 = self.full is not None
        t = self.full.pop(key).to(device) if rank0 else torch.empty(shape, dtype=dtype,
                                                                     device=device)
        dist.broadcast(t, group=self.group, group_src=0)
        return t


def _reset_from_source(source: ModuleSource, prefix: str, module, holders: dict) -> None:
    """``module.reset_parameters`` under meta-device initialization: megatron-fsdp has just
    allocated the module's own parameters (``to_empty(recurse=False)``); fill them with the
    run's initial values, and point every other module holding one of them (tied weights) at
    the new parameter."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            p.copy_(source.tensor(_clean(f"{prefix}{name}"), p.device).to(p.dtype))
            for other, other_name in holders.get((id(module), name), ()):
                setattr(other, other_name, p)


def prepare_meta_init(part, fill, device) -> None:
    """Under ``init_fsdp_with_meta_device``: leave the parameters on the meta device (nothing
    allocated before the wrap) and give every module holding parameters a
    ``reset_parameters`` that fills them from ``fill.source`` (a ``ModuleSource``) once the
    library has allocated them; buffers (computed on the host by the meta build) move to
    ``device`` now, the library only allocates parameters."""
    source = fill.source
    owners: dict = {}  # id(meta parameter) -> every (module, name) holding it
    for module in part.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, name))
        for name, b in direct_buffers(module):
            if b is not None:
                set_buffer(module, name, b.to(device))
    for mname, module in part.named_modules():
        direct = list(module.named_parameters(recurse=False))
        if not direct:
            continue
        holders = {(id(module), n): [(m, mn) for m, mn in owners[id(p)] if m is not module]
                   for n, p in direct}
        module.reset_parameters = functools.partial(
            _reset_from_source, source, f"{mname}." if mname else "", module, holders)
