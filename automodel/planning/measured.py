"""Communication measured in a real run (``trainer.profile_steps``), to set beside the plan.

Two records of the profiled steps, both written by torch itself on each rank:

- the profiler's trace (``profile/trace_rank<r>.json``, shapes recorded): every c10d operator
  the rank ran (``c10d::_allgather_base_``, ``c10d::allreduce_``, ...), with its tensors'
  sizes: the collective as automodel (FSDP2, DTensor, the pipeline) asked for it;
- c10d's flight recorder (``profile/collectives_rank<r>.json``): each collective the backend
  ran, with its process group's name and description (``mesh_dp_shard``: the mesh axis).

The profiler has no process group and gloo records no ``record_param_comms`` events (torch
2.13); the flight recorder has the group, but on gloo a reduce-scatter runs (and is recorded)
as an all-reduce of its whole input, and sends and receives are not recorded. So each c10d
operator gives the kind and the bytes, and the flight recorder entry created inside it (the
same wall clock) gives the group. A send or receive has no entry: it is counted on
``p2p_axis`` (automodel's only point-to-point traffic is the pipeline's, on ``pp``).

Bytes, as the planner counts them: the collective's tensor on this rank (all_gather: the
gathered output; reduce_scatter: the input; all_reduce, broadcast, send, recv: the tensor;
all_to_all: what this rank sends). The step's own bookkeeping read (``automodel::read``) is
left out, and so are collectives on a group of one rank (a mesh axis of size 1: nothing
leaves the rank; the planner does not count them either).
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

# c10d operator -> (kind, which of its tensor arguments holds the bytes)
_OPS = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::alltoall_base_": ("all_to_all", 1),
    "c10d::alltoall_": ("all_to_all", 1),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::send": ("send", 0),
    "c10d::recv_": ("recv", 0),
    "c10d::recv_any_source_": ("recv", 0),
}
# the profiler's and the flight recorder's names of element types -> bytes
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8,
                "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
                "Float": 4, "Double": 8, "BFloat16": 2, "Half": 2, "Long": 8, "Int": 4,
                "Short": 2, "Char": 1, "Byte": 1, "Bool": 1}


def comm_bytes_from_trace(trace_path: str, axis_of_ranks: dict | None = None,
                          p2p_axis: str = "pp") -> dict[str, dict[str, int]]:
    """Bytes per step on each mesh axis and collective kind, on the rank whose profiler trace
    is ``trace_path`` (``collectives_rank<r>.json`` beside it), averaged over the profiled
    steps. The axis: the group's description ``mesh_<axis>`` (``default_pg``: ``world``),
    else ``axis_of_ranks[tuple(group ranks)]``, else the description."""
    with open(trace_path) as f:
        trace = json.load(f)
    recorded = _read_collectives(trace_path)
    ranks_of = {str(pg["pg_name"]): tuple(json.loads(pg["ranks"]) if isinstance(
        pg["ranks"], str) else pg["ranks"]) for pg in
        trace.get("distributedInfo", {}).get("pg_config", [])}
    base = int(trace.get("baseTimeNanoseconds", 0))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = _spans(events, "automodel::step", base)
    skipped = _spans(events, "automodel::read", base)
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in _outermost([e for e in events if e.get("name") in _OPS]):
        start, end = base + int(e["ts"] * 1000), base + int((e["ts"] + e["dur"]) * 1000)
        if not _inside(start, steps) or _inside(start, skipped):
            continue
        kind, arg = _OPS[e["name"]]
        entry = next((c for c in recorded if start <= c["time_created_ns"] <= end), None)
        if entry is None and kind not in ("send", "recv"):
            raise ValueError(f"{trace_path}: {e['name']} at {start} ns has no flight-recorder "
                             "entry (was TORCH_FR_BUFFER_SIZE set before the process group "
                             "started?)")
        if entry is not None and len(ranks_of.get(str(entry["pg_name"]), "..")) == 1:
            continue  # a group of one rank: nothing leaves the rank (the planner's rule)
        axis = p2p_axis if entry is None else _axis(entry, ranks_of, axis_of_ranks or {})
        out[axis][kind] += _bytes(e, arg, entry, events)
    n = max(len(steps), 1)
    return {axis: {kind: b // n for kind, b in kinds.items()} for axis, kinds in out.items()}


def _read_collectives(trace_path: str) -> list[dict]:
    folder, name = os.path.split(trace_path)
    path = os.path.join(folder, name.replace("trace_", "collectives_", 1))
    with open(path) as f:
        data = json.load(f)
    if data["collectives"] and not data["complete"]:
        raise ValueError(f"{path}: the flight recorder lost the first collectives of the "
                         "profiled steps (its buffer, TORCH_FR_BUFFER_SIZE, is too small)")
    return data["collectives"]


def _outermost(ops: list) -> list:
    """The operators not inside another of them on the same thread (a send can show as an
    operator inside an operator of the same name)."""
    kept, open_until = [], {}
    for e in sorted(ops, key=lambda e: (e["tid"], e["ts"], -e["dur"])):
        if e["ts"] < open_until.get(e["tid"], float("-inf")):
            continue
        kept.append(e)
        open_until[e["tid"]] = e["ts"] + e["dur"]
    return kept


def _spans(events: list, name: str, base: int) -> list[tuple[int, int]]:
    return [(base + int(e["ts"] * 1000), base + int((e["ts"] + e["dur"]) * 1000))
            for e in events if e.get("name") == name]


def _inside(t: int, spans: list) -> bool:
    return any(a <= t <= b for a, b in spans)


def _axis(entry: dict, ranks_of: dict, axis_of_ranks: dict) -> str:
    desc = entry["pg_desc"]
    if desc.startswith("mesh_"):
        return desc[len("mesh_"):]
    if desc == "default_pg":
        return "world"
    return axis_of_ranks.get(ranks_of.get(str(entry["pg_name"])), desc)


def _bytes(op: dict, arg: int, entry: dict | None, events: list) -> int:
    """The elements of tensor argument ``arg`` (a tensor or a list of them) times the size
    of their element type: the profiler's; for a list, the flight recorder's, else that of
    the backend's own record of the transfer (``gloo:send``) that follows on the thread."""
    args = op["args"]
    dims = args["Input Dims"][arg]
    shapes = dims if dims and isinstance(dims[0], list) else [dims]
    elements = sum(math.prod(s) for s in shapes)
    kind = args["Input type"][arg]
    size = _DTYPE_BYTES.get(kind)
    if size is None and entry is not None:
        size = _DTYPE_BYTES.get((entry["input_dtypes"] or ["?"])[0])
    if size is None:
        backend = next((e for e in events if e["tid"] == op["tid"] and e["ts"] >= op["ts"]
                        and str(e.get("name")).split(":")[0] in ("gloo", "nccl")
                        and e.get("args", {}).get("Input Dims") == shapes[:1]), None)
        size = _DTYPE_BYTES.get(backend["args"]["Input type"][0]) if backend else None
    if size is None:
        raise ValueError(f"unknown element type {kind!r} of {op['name']}")
    return elements * size


def comm_bytes_by_axis(trace_path: str, layout, p2p_axis: str = "pp") -> dict:
    """``comm_bytes_from_trace`` keyed as the planner keys its bytes: each group under
    ``layout.canonical_axis`` of its mesh name, the bytes of groups that share a name (two
    views over the same ranks, as ``dp_shard_cp`` and ``dp_cp`` without cp or replication)
    added together."""
    out: dict = defaultdict(lambda: defaultdict(int))
    for axis, kinds in comm_bytes_from_trace(trace_path, p2p_axis=p2p_axis).items():
        for kind, n in kinds.items():
            out[layout.canonical_axis(axis)][kind] += n
    return {axis: dict(kinds) for axis, kinds in sorted(out.items())}
