"""Bytes of every collective a rank issues, by mesh axis and kind, counted as the ops run.

``CommCounter`` sees every op of the simulated step (``counters.StepCounters``): each c10d or
functional collective op is sized (the bytes below) and keyed by the mesh axis whose process
group it runs on. Under the planner it sits above ``FakeTensorMode`` on a fake process group,
so automodel's real code (FSDP2, DTensor redistributions, the pipeline's sends) is what gets
counted.

Bytes, per rank and per op (``numel * element_size`` of the tensors named):
- ``all_gather``: the gathered output;
- ``reduce_scatter``: the input (the whole tensor before scattering);
- ``all_reduce`` / ``broadcast``: the tensor;
- ``all_to_all``: what this rank sends (its input);
- ``send`` / ``recv``: the tensor.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from automodel.compat.planning import collective_group, collective_ops, op_name

# op name -> (kind, where the sized tensors are: an argument index, or "out" for the result)
_OPS = {
    "allreduce_": ("all_reduce", 0), "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0), "all_reduce_coalesced": ("all_reduce", 0),
    "all_reduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "all_gather_into_tensor_out": ("all_gather", -1),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0), "shard_dim_alltoall": ("all_to_all", 0),
    "send": ("send", 0), "isend": ("send", 0),
    "recv_": ("recv", 0), "recv_any_source_": ("recv", 0), "irecv": ("recv", 0),
}
_NOT_COUNTED = {"barrier", "monitored_barrier_", "wait_tensor"}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "recv",
         "broadcast")


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a tensor or nested lists of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


class CommCounter:
    """Counts collective bytes per (axis, kind). ``axis_of``: process group -> axis name;
    a group it does not know is named by its ranks (``ranks 0,3``)."""

    def __init__(self, axis_of: dict):
        self.axis_of = axis_of
        self.bytes: dict = defaultdict(lambda: defaultdict(int))
        self.calls: dict = defaultdict(lambda: defaultdict(int))
        self._ops = collective_ops()

    def observe(self, func, args, kwargs, out) -> None:
        if func in self._ops:
            self._count(func, args, out)

    def _count(self, func, args, out) -> None:
        name = op_name(func)
        if name in _NOT_COUNTED:
            return
        if name == "batch_p2p_ops":  # (ops, peers, tags, tensors, group)
            for op, tensor in zip(args[0], args[3]):
                self._add(func, args, "send" if "send" in op else "recv", tensor_bytes(tensor))
            return
        if name not in _OPS:
            raise NotImplementedError(f"the planner does not know how to size {func}: add it "
                                      "to automodel/costing/comm.py")
        kind, where = _OPS[name]
        self._add(func, args, kind, tensor_bytes(out if where == "out" else args[where]))

    def _add(self, func, args, kind: str, n: int) -> None:
        group = collective_group(func, args)
        if group.size() == 1:
            return  # (nothing leaves the rank)
        axis = self.axis_of.get(group)
        if axis is None:
            axis = "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
        self.bytes[axis][kind] += n
        self.calls[axis][kind] += 1

    def result(self) -> dict:
        return {axis: dict(kinds) for axis, kinds in sorted(self.bytes.items())}

    def call_counts(self) -> dict:
        return {axis: dict(kinds) for axis, kinds in sorted(self.calls.items())}


def axis_groups(mesh) -> dict:
    """process group -> mesh axis name, for a ``MeshContext``: the base axes, the flattened
    views, the MoE mesh's axes and the world. Where two names share one group the first in
    that order wins."""
    from automodel.distributed.mesh import BASE_AXES, FLATTENED

    named: dict = {}
    for axis in (*BASE_AXES, *FLATTENED):
        if mesh.size(axis) > 1:
            named.setdefault(mesh[axis].get_group(), mesh.layout.canonical_axis(axis))
    if mesh.moe is not None:
        for name in mesh.moe.mesh_dim_names:
            if mesh.moe[name].size() > 1:
                named.setdefault(mesh.moe[name].get_group(), name)
    named.setdefault(dist.group.WORLD, "world")
    return named
