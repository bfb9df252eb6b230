"""``parallelism=ddp`` for the planner: torch DDP's reducer, re-enacted in Python.

torch's ``DistributedDataParallel`` keeps its gradient buckets in a C++ reducer that reads
data pointers, which fake tensors do not have. ``PlannedDDP`` does what that reducer does to
a rank's memory and to its communication, on fake tensors, step by step:

- **Parameters**: those of the module that require a gradient, module by module, shared
  ones once (DDP's ``_build_params_for_reducer``).
- **Buckets**: torch's own assignment (``dist._compute_bucket_assignment_by_size``). At the
  wrap: one bucket per dtype (``find_unused_parameters=false`` or ``static_graph``), else
  buckets of ``bucket_cap_mb`` (a first of 1 MiB when ``bucket_cap_mb`` is null) in reverse
  parameter order. After the first synchronized backward they are rebuilt at the next
  forward, in the order the gradients became ready (parameter order under
  ``static_graph``), with the first bucket's limit and then ``bucket_cap_mb``; the rebuilt
  assignment is broadcast from rank 0 (two small int32 tensors), as DDP does.
- **Memory**: the bucket storage is allocated at the wrap, one flat tensor per dtype of the
  size of all its gradients (DDP frees the old buckets before it allocates the rebuilt ones,
  so the bytes are the same at every moment); it is a non-persistent buffer of the wrapper,
  so that the memory tracker counts it from the start (the tracker's ``Buffer`` kind). With
  ``gradient_as_bucket_view`` each gradient becomes a view of it when ready (no other
  gradient memory); without, gradients are separate tensors, copied into the buckets and
  back.
- **Communication** (on the data-parallel group): each gradient is multiplied by 1/world
  into its bucket when ready; a bucket is all-reduced when all of its gradients are, in
  bucket order; ``find_unused_parameters`` adds the all-reduce of the int32 used-parameter
  map each backward and finds the unused parameters by walking the outputs' autograd graph;
  ``broadcast_buffers`` broadcasts the buffers before a forward that follows a synchronized
  one (in coalesced groups of 250 MiB).
- ``no_sync()``: the backward of a forward run under it accumulates gradients locally and
  reduces nothing.

Not re-enacted (they happen once, before the first step): the check of parameter shapes
across ranks and the broadcast of the parameters at the wrap. Sparse gradients are refused.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from automodel.compat.planning import ddp_bucket_assignment, ddp_bucket_caps

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size
_UNFINISHED = ("Expected to have finished reduction in the prior iteration before starting a "
               "new one. This error indicates that your module has parameters that were not "
               "used in producing loss (the planner's DDP re-enactment).")


@dataclass
class _Bucket:
    indices: list  # parameter indices
    flat: torch.Tensor = None  # the bucket: a slice of its dtype's storage
    pending: int = 0


@dataclass
class _Iteration:
    """What the reducer tracks between a synchronized forward and the end of its backward."""

    expect_hooks: bool = False
    started: bool = False
    unused: list = field(default_factory=list)  # marked ready at the first hook
    next_bucket: int = 0


class PlannedDDP(nn.Module):
    def __init__(self, module: nn.Module, group, opts):
        super().__init__()
        self.module = module
        self.process_group = group
        self.world = dist.get_world_size(group)
        self.find_unused_parameters = opts.find_unused_parameters
        self.gradient_as_bucket_view = opts.gradient_as_bucket_view
        self.static_graph = opts.static_graph
        self.forward_sync_buffers = opts.broadcast_buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.params = _params_for_reducer(module)
        self.first_bucket_bytes, self.bucket_bytes = ddp_bucket_caps(opts.bucket_cap_mb)
        self._storage = {}
        for dtype in dict.fromkeys(p.dtype for p in self.params):
            n = sum(p.numel() for p in self.params if p.dtype == dtype)
            self._storage[dtype] = torch.empty(n, dtype=dtype, device=self.params[0].device)
            # (a buffer of the wrap, not of the module: the memory tracker knows it from the
            # start, as the buckets live from the wrap on; never saved)
            self.register_buffer(f"_ddp_buckets_{str(dtype).split('.')[-1]}",
                                 self._storage[dtype], persistent=False)
        self._set_buckets(self._initial_assignment())
        self._rebuilt_order: list = []
        self._has_rebuilt = False
        self._iteration = _Iteration()
        self._first_iteration = True
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda param, i=i: self._autograd_hook(i))

    # ------------------------------------------------------------------- buckets
    def _initial_assignment(self) -> list:
        if self.static_graph or not self.find_unused_parameters:
            limits = [sys.maxsize]
        elif self.first_bucket_bytes < self.bucket_bytes:
            limits = [self.first_bucket_bytes, self.bucket_bytes]
        else:
            limits = [self.bucket_bytes]
        return list(reversed(ddp_bucket_assignment(self.params, limits)))

    def _set_buckets(self, assignment: list) -> None:
        self.buckets = [_Bucket(list(ix)) for ix in assignment]
        self._views: dict = {}
        self._bucket_of: dict = {}
        offsets = dict.fromkeys(self._storage, 0)
        for b, bucket in enumerate(self.buckets):
            dtype = self.params[bucket.indices[0]].dtype
            start = offsets[dtype]
            for i in bucket.indices:
                p = self.params[i]
                self._views[i] = self._storage[dtype][offsets[dtype]:
                                                      offsets[dtype] + p.numel()].view(p.shape)
                self._bucket_of[i] = b
                offsets[dtype] += p.numel()
            bucket.flat = self._storage[dtype][start:offsets[dtype]]

    def _should_rebuild(self) -> bool:
        return (self.static_graph or not self.find_unused_parameters) and not self._has_rebuilt

    def _rebuild_buckets(self) -> None:
        """At a forward after the first synchronized backward (DDP's ``_rebuild_buckets``)."""
        if not self._should_rebuild() or not self._rebuilt_order:
            return
        order = list(range(len(self.params))) if self.static_graph else self._rebuilt_order
        limits = [self.first_bucket_bytes, self.bucket_bytes]
        assignment = ddp_bucket_assignment([self.params[i] for i in order], limits, order)
        device = self.params[0].device  # (the reducer's sync_bucket_indices)
        for n in (len(order) + 1, len(assignment)):
            dist.broadcast(torch.empty(n, dtype=torch.int32, device=device),
                           group=self.process_group, group_src=0)
        self._has_rebuilt, self._rebuilt_order = True, []
        self._set_buckets(assignment)

    # ------------------------------------------------------------------- forward
    @contextlib.contextmanager
    def no_sync(self):
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, *args, **kwargs):
        grad = torch.is_grad_enabled()
        if grad and self.require_backward_grad_sync and self._iteration.started:
            raise RuntimeError(_UNFINISHED)
        if grad:
            self._rebuild_buckets()
        if self.forward_sync_buffers and self.require_forward_param_sync:
            self._sync_buffers()
        out = self.module(*args, **kwargs)
        if grad and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            self._iteration = _Iteration(expect_hooks=True)
            if self.find_unused_parameters and not self.static_graph:
                used = _reachable_parameters(out)
                self._iteration.unused = [i for i, p in enumerate(self.params)
                                          if id(p) not in used]
        else:
            self.require_forward_param_sync = False
        return out

    def _sync_buffers(self) -> None:
        buffers = list(self.module.buffers())
        if not buffers:
            return
        for group in ddp_bucket_assignment(buffers, [_BROADCAST_BUCKET_BYTES]):
            flat = torch.cat([buffers[i].reshape(-1) for i in group])
            dist.broadcast(flat, group=self.process_group, group_src=0)
            offset = 0
            for i in group:
                n = buffers[i].numel()
                buffers[i].copy_(flat[offset:offset + n].view_as(buffers[i]))
                offset += n

    # ------------------------------------------------------------------- backward
    def _autograd_hook(self, index: int) -> None:
        it = self._iteration
        if not it.expect_hooks:
            return
        if not it.started:
            it.started = True
            for i in it.unused:
                self._mark_ready(i)
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if self._should_rebuild():
            self._rebuilt_order.append(index)
        param, view = self.params[index], self._views[index]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad is view:  # (accumulated in place into its bucket view)
            view.div_(self.world)
        else:
            torch.mul(grad, 1.0 / self.world, out=view)
            if self.gradient_as_bucket_view:
                param.grad = view
        bucket = self.buckets[self._bucket_of[index]]
        bucket.pending += 1
        it = self._iteration
        while it.next_bucket < len(self.buckets) and \
                self.buckets[it.next_bucket].pending == len(self.buckets[it.next_bucket].indices):
            dist.all_reduce(self.buckets[it.next_bucket].flat, group=self.process_group)
            it.next_bucket += 1
        if it.next_bucket == len(self.buckets):
            self._finalize()

    def _finalize(self) -> None:
        if (self.find_unused_parameters and not self.static_graph) or \
                (self.static_graph and self._first_iteration):
            used_map = torch.empty(len(self.params), dtype=torch.int32,
                                   device=self.params[0].device)
            dist.all_reduce(used_map, group=self.process_group)
        if not self.gradient_as_bucket_view:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    p.grad.copy_(self._views[i])
        for bucket in self.buckets:
            bucket.pending = 0
        self._iteration = _Iteration()
        self._first_iteration = False


def _params_for_reducer(module: nn.Module) -> list:
    """DDP's parameter list: by module, those requiring a gradient, each once."""
    seen, params = set(), []
    for sub in module.modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise NotImplementedError("the planner's DDP does not model sparse gradients "
                                      f"({type(sub).__name__}(sparse=True))")
        for p in sub.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    if not params:
        raise ValueError("DDP needs a module with at least one parameter that requires a "
                         "gradient")
    return params


def _reachable_parameters(out) -> set:
    """ids of the leaf tensors the outputs' autograd graph reaches (DDP's search for the
    parameters that took part in the forward)."""
    stack, seen, found = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None], set(), set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(f for f, _ in fn.next_functions)
    return found


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def wrap_planned_ddp(part: nn.Module, blocks: list, setup, experts: list) -> PlannedDDP:
    """The planner's ``parallelism=ddp`` wrap (``wrap_ddp``'s group and options)."""
    from automodel.distributed.mesh import MeshAxis

    return PlannedDDP(part, setup.mesh[MeshAxis.DP].get_group(), setup.options)
