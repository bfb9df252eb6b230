"""One dispatch mode that shows every operator of the simulated step to the planner's
counters (``comm.CommCounter``, ``flops.FlopCounter``): one Python frame per operator for all
of them, as each mode stacked on the fake mode costs one.

DTensor's operators are passed on (``NotImplemented``): DTensor runs them as operators on
this rank's shards (and its own collectives), which come back here and are counted. DTensor's
shape propagation (fake tensors of global shapes) is not the rank's work and is not shown.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from automodel.compat import dispatch_mode_base
from automodel.compat.planning import in_sharding_propagation


class StepCounters(dispatch_mode_base()):
    def __init__(self, *counters):
        super().__init__()
        self.counters = counters

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if in_sharding_propagation():
            return func(*args, **kwargs)
        if DTensor in types:
            return NotImplemented
        out = func(*args, **kwargs)
        for counter in self.counters:
            counter.observe(func, args, kwargs, out)
        return out
