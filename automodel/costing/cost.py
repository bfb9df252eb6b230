"""The step-time model: plain numbers in (FLOPs, collective bytes per mesh axis, the mesh's
sizes, the pipeline bubble, a ``GpuProfile``), seconds out. Torch-free; stated in
docs/planning.md ("Cost model").

- compute: ``flops / (peak_bf16_flops * compute_efficiency)``;
- a collective of ``B`` bytes (this rank's tensor, as ``costing/comm.py`` counts it) over the
  ``n`` ranks of an axis, at bus bandwidth ``bw`` (the link's, times ``comm_efficiency``; NVLink
  when the axis stays inside a node, the network otherwise): ring all-gather, reduce-scatter
  and all-to-all ``(n-1)/n * B / bw``, all-reduce ``2(n-1)/n * B / bw``, broadcast, send and
  recv ``B / bw`` (a rank's sends and receives on an axis overlap: the longer counts);
- the data-parallel gathers and reductions overlap compute and only their excess is exposed;
  every other collective (tp, cp, ep, pipeline sends) is on the critical path;
- the bubble: the rank is busy ``compute + exposed`` for ``1 - bubble`` of the step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

from automodel.config import layout as layout_axes
from automodel.config.build import ConfigError
from automodel.config.layout import BASE_AXES, FLATTENED
from automodel.costing.gpus import GpuProfile

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "recv",
         "broadcast")
# the mesh's axes (outermost first), its flattened views and the MoE regrouping of a stage's
# dp x cp x tp ranks (ep innermost): config/layout.py's
MOE_AXES = tuple(a for a in layout_axes.MOE_AXES if a != "pp")
AXES = (*BASE_AXES, *FLATTENED, *MOE_AXES, "world")
# Collectives that overlap compute: FSDP's parameter all-gathers and gradient reduce-scatters,
# and DDP's / HSDP's gradient all-reduces, on the data-parallel axes (ep_shard: the experts').
DATA_AXES = ("dp_replicate", "dp_shard", "dp", "dp_shard_cp", "dp_cp", "ep_shard")
OVERLAPPED_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
CALIBRATION_KEYS = ("compute_efficiency", "comm_efficiency", "bandwidth")


def mesh_sizes(layout) -> dict[str, int]:
    """The base axes' sizes and ``ep`` of ``layout``: a mapping (``pp``, ``dp_replicate``,
    ``dp_shard``, ``cp`` or ``cp_ring``, ``cp_ulysses``, ``tp``, ``ep``; missing ones are 1) or
    a ``Layout``."""
    get = layout.get if isinstance(layout, Mapping) else (lambda k, d: getattr(layout, k, d))
    ulysses = get("cp_ulysses", None) or 1
    ring = get("cp_ring", None) or (get("cp", None) or ulysses) // ulysses
    sizes = {"pp": get("pp", None), "dp_replicate": get("dp_replicate", None),
             "dp_shard": get("dp_shard", None), "cp_ring": ring, "cp_ulysses": ulysses,
             "tp": get("tp", None), "ep": get("ep", None)}
    sizes = {k: 1 if v is None else v for k, v in sizes.items()}
    for k, v in sizes.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"mesh size {k}={v!r} must be an int >= 1 (layout: {layout!r})")
    stage = math.prod(sizes[a] for a in BASE_AXES[1:])
    if stage % sizes["ep"]:
        raise ValueError(f"ep={sizes['ep']} must divide dp*cp*tp={stage}")
    return sizes


def axis_extent(layout, axis: str) -> tuple[int, int]:
    """(size, stride) of ``axis``: its ranks in one group are ``r, r + stride, ...``."""
    sizes = mesh_sizes(layout)
    stage = math.prod(sizes[a] for a in BASE_AXES[1:])
    if axis == "world":
        return sizes["pp"] * stage, 1
    if axis in MOE_AXES:
        ep = sizes["ep"]
        return {"ep": (ep, 1), "ep_unit": (1, ep), "ep_shard": (stage // ep, ep)}[axis]
    parts = FLATTENED.get(axis, (axis,))
    if any(p not in BASE_AXES for p in parts):
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)} "
                         "(or 'ranks i,j,...' for a group of named ranks)")
    inner = BASE_AXES[BASE_AXES.index(parts[-1]) + 1:]
    return math.prod(sizes[p] for p in parts), math.prod(sizes[a] for a in inner)


def axis_spans_nodes(layout_sizes, axis: str, gpus_per_node: int) -> bool:
    """Whether a group of ``axis`` holds ranks of two nodes, ranks being numbered node by node
    (``gpus_per_node`` consecutive ranks a node). ``axis``: a mesh axis, or ``"ranks i,j,..."``
    (a group the planner names by its ranks)."""
    if axis.startswith("ranks "):
        ranks = [int(r) for r in axis[len("ranks "):].split(",")]
        return len({r // gpus_per_node for r in ranks}) > 1
    size, stride = axis_extent(layout_sizes, axis)
    world = axis_extent(layout_sizes, "world")[0]
    span = size * stride  # a block of consecutive ranks holding whole groups
    if size == 1 or world <= gpus_per_node or (span <= gpus_per_node
                                               and gpus_per_node % span == 0):
        return False
    if (size - 1) * stride >= gpus_per_node:
        return True
    firsts = (r for r in range(world) if (r // stride) % size == 0)
    return any(r // gpus_per_node != (r + (size - 1) * stride) // gpus_per_node for r in firsts)


def group_size(layout_sizes, axis: str) -> int:
    if axis.startswith("ranks "):
        return len(axis[len("ranks "):].split(","))
    return axis_extent(layout_sizes, axis)[0]


def collective_seconds(kind: str, nbytes: float, n: int, bandwidth: float) -> float:
    """Seconds of one ring collective of ``nbytes`` (this rank's tensor) over ``n`` ranks at
    bus bandwidth ``bandwidth`` (B/s)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; the kinds are {', '.join(KINDS)}")
    if kind in ("send", "recv", "broadcast"):
        factor = 1.0 if n > 1 or kind != "broadcast" else 0.0
    else:
        factor = (n - 1) / n * (2 if kind == "all_reduce" else 1)
    return factor * nbytes / bandwidth


def overlaps_compute(axis: str, kind: str) -> bool:
    """The overlap rule: data-parallel gathers and reductions hide behind compute; the rest
    (tp, cp, ep all-to-all, pipeline send/recv, the world's reductions) does not."""
    return axis in DATA_AXES and kind in OVERLAPPED_KINDS


def check_calibration(calibration: Mapping | None) -> dict:
    """``calibration`` checked: ``compute_efficiency`` and ``comm_efficiency`` (fractions
    measured on the real job) and ``bandwidth`` (axis -> measured bus bandwidth, B/s, as
    nccl-tests reports ``busbw``). A copy; the input is not changed."""
    calibration = dict(calibration or {})
    unknown = sorted(set(calibration) - set(CALIBRATION_KEYS))
    if unknown:
        raise ConfigError(f"plan.calibration has no key {', '.join(unknown)}; the keys are "
                          f"{', '.join(CALIBRATION_KEYS)}")
    for key in ("compute_efficiency", "comm_efficiency"):
        if key in calibration and not 0 < calibration[key] <= 1:
            raise ConfigError(f"plan.calibration.{key}={calibration[key]!r} must be a "
                              "fraction in (0, 1]")
    bandwidth = dict(calibration.get("bandwidth") or {})
    for axis, value in bandwidth.items():
        if not value > 0:
            raise ConfigError(f"plan.calibration.bandwidth.{axis}={value!r} must be > 0 (B/s)")
    calibration["bandwidth"] = bandwidth
    return calibration


def axis_bandwidth(layout_sizes, axis: str, profile: GpuProfile,
                   calibration: Mapping | None = None) -> float:
    """The bus bandwidth (B/s) a collective on ``axis`` reaches: the measured one when the
    calibration has it, else the link's (NVLink inside a node, the network across nodes)
    times the communication efficiency."""
    calibration = check_calibration(calibration)
    if axis in calibration["bandwidth"]:
        return float(calibration["bandwidth"][axis])
    across = axis_spans_nodes(layout_sizes, axis, profile.gpus_per_node)
    link = profile.inter_node_bandwidth if across else profile.intra_node_bandwidth
    return link * calibration.get("comm_efficiency", profile.comm_efficiency)


@dataclass
class StepTime:
    """One rank class's predicted step, in seconds."""

    compute_s: float
    comm_s: dict[str, float] = field(default_factory=dict)  # axis -> all its collectives
    overlapped_comm_s: float = 0.0  # data-parallel collectives that may hide behind compute
    exposed_comm_s: float = 0.0  # on the critical path (what the overlap did not hide)
    bubble_s: float = 0.0
    step_time_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def step_time(flops: float, comm: Mapping[str, Mapping[str, float]], layout_sizes,
              profile: GpuProfile, bubble: float = 0.0,
              calibration: Mapping | None = None) -> StepTime:
    """The predicted step of one rank class: ``flops`` per step (forward, backward and any
    recompute), ``comm`` (axis -> collective kind -> bytes per step on this rank), the mesh's
    sizes (``mesh_sizes``), the pipeline ``bubble`` (idle fraction of the step, from the
    schedule) and the GPU; ``calibration`` (``check_calibration``) overrides the profile."""
    if not 0 <= bubble < 1:
        raise ValueError(f"bubble={bubble!r} must be a fraction in [0, 1)")
    calibration = check_calibration(calibration)
    efficiency = calibration.get("compute_efficiency", profile.compute_efficiency)
    compute = flops / (profile.peak_bf16_flops * efficiency)
    per_axis, overlapped, critical = {}, 0.0, 0.0
    for axis, kinds in comm.items():
        n = group_size(layout_sizes, axis)
        bw = axis_bandwidth(layout_sizes, axis, profile, calibration)
        seconds = _duplex({k: collective_seconds(k, b, n, bw) for k, b in kinds.items()})
        per_axis[axis] = sum(seconds.values())
        for kind, s in seconds.items():
            if overlaps_compute(axis, kind):
                overlapped += s
            else:
                critical += s
    exposed = critical + max(0.0, overlapped - compute)
    busy = compute + exposed
    total = busy / (1 - bubble)
    return StepTime(compute, per_axis, overlapped, exposed, total - busy, total)


def _duplex(seconds: dict[str, float]) -> dict[str, float]:
    """A rank's sends and receives on one axis share a full-duplex link (torch's 1F1B
    batches a forward send with a backward receive): together they cost the longer of the two."""
    send, recv = seconds.get("send", 0.0), seconds.get("recv", 0.0)
    out = {k: v for k, v in seconds.items() if k not in ("send", "recv")}
    if send or recv:
        out["send" if send >= recv else "recv"] = max(send, recv)
    return out


def job_step_time(times: Iterable[StepTime]) -> StepTime:
    """The job's step: the slowest rank class (every rank waits for it each step)."""
    return max(times, key=lambda t: t.step_time_s)
