"""The pipeline bubble and the in-flight micro-batches, from the torch schedule's own action
list (not a closed-form formula), on one CPU process without any process group.

1. The schedule. ``planned_schedule`` builds the very torch schedule object a run builds for
   the pipeline config: the stage placement comes from ``schedule.stage_layout`` and the
   class and its arguments from ``schedule.make_schedule`` (the code ``split_model`` and
   ``build_schedule`` run), over stand-in stages of pp rank 0 that carry only what the
   schedules' constructors read (stage index, stage count, group rank and size). torch
   computes every rank's actions from any one rank's stages.
2. The action list. ``compat.lowered_actions``: for the multi-stage and CSV schedules (torch's
   ``_PipelineScheduleRuntime``) the lowered ``pipeline_order_with_comms``, the list their
   runtime walks (compute, send/recv, unshard/reshard, reduce-grad; ``OVERLAP_F_B`` split into
   its F and B, run one after the other). GPipe and 1F1B have no runtime list: their
   ``_step_microbatches`` hard-codes the order, which torch also writes as ``pipeline_order``.
   We use that list with one documented repair: ``_step_microbatches`` runs the i-th forward
   and the i-th backward of a rank on micro-batch i, while torch 2.13's
   ``Schedule1F1B.pipeline_order`` numbers the last rank's forwards 1..m (its F/B order is
   right), so for single-stage schedules the micro-batches are renumbered in order of
   appearance. The order is then checked: every (stage, micro-batch) runs one forward and one
   backward (B, or I then W).
3. Timing. Each rank runs its compute actions in that order, each as soon as the rank is free
   and its inputs exist: F(s, m) after F(s-1, m); B or I (input grad) of (s, m) after F(s, m)
   and after B/I of (s+1, m); W(s, m) after I(s, m). A dependency across ranks adds ``p2p``
   (default 0: communication is not part of the bubble). Costs: ``weights`` per kind (default
   F = 1, full backward B = 2, split I = W = 1), times ``stage_weights[s]`` per stage when
   given (uneven stages). Comms actions take no time.
4. Bubble = idle / (ranks x makespan), makespan from time 0 to the last action's end. For
   GPipe and 1F1B it is exactly (p - 1) / (m + p - 1) whatever B costs, and for interleaved
   1F1B (and looped BFS) exactly (p - 1) / (v m + p - 1) when m >= p; with fewer
   micro-batches than ranks torch's interleaved order idles more (``tests/planning``).
5. In flight: per stage, the most micro-batches whose forward has started and whose
   activations are not yet released: at the end of B, or of W when the backward is split (W
   still needs the stage's saved inputs). For 1F1B that is min(p - stage, m), for GPipe m.

torch's own picture (``_schedule_visualizer.get_schedule_ops(add_spacing=True)``) is a grid
of list slots, not a timing: it counts a full backward (timed as 2) and an ``OVERLAP_F_B``
(timed as 3) as one slot each. So its idle-slot share (Interleaved1F1B 0.22, ZBVZeroBubble
0.059, DualPipeV 0.219 at p=4, m=8, v=2) agrees with this timing only where every action is
one unit and nothing overlaps (ZBVZeroBubble).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Mapping, NamedTuple, Sequence

from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from automodel.compat.pipeline_stage import lowered_actions
from automodel.config.pipeline_layout import canonical_schedule
from automodel.distributed.pipelining.schedule import make_schedule, stage_layout

COMPUTE = ("F", "B", "I", "W")
DEFAULT_WEIGHTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class Block(NamedTuple):
    """One compute action on one rank: it runs over [start, start + duration)."""
    start: float
    duration: float
    kind: str        # "F", "B" (full backward), "I" (input grad) or "W" (weight grad)
    stage: int
    microbatch: int


@dataclass
class Timeline:
    name: str                     # automodel's schedule name ("1f1b", ..., "csv")
    schedule_class: str           # the torch class that runs it
    pp_size: int
    n_microbatches: int
    num_stages: int
    stages_by_rank: list[list[int]]
    ranks: list[list[Block]]      # ranks[r]: rank r's compute blocks in run order
    makespan: float
    weights: dict[str, float]
    lowered: list[list[tuple]]    # ranks[r]'s whole action list (kind, stage, micro-batch)


def _stand_in(index: int, num_stages: int, pp_size: int):
    """What the schedules' constructors read of a ``PipelineStage`` of pp rank 0."""
    return SimpleNamespace(num_stages=num_stages, stage_index=index, group_rank=0,
                           group_size=pp_size, submod=None, is_first=index == 0,
                           is_last=index == num_stages - 1)


def planned_schedule(pipeline_cfg, pp: int, n_microbatches: int,
                     num_layers: int | None = None):
    """The torch schedule object a run builds for ``pipeline_cfg`` (a ``PipelineConfig``)
    with ``mesh.pp_size=pp`` and ``n_microbatches``, seen from pp rank 0. ``num_layers``:
    the model's layer count, needed only with ``pipeline.layers_per_stage``."""
    if pp < 1 or n_microbatches < 1:
        raise ValueError(f"pp ({pp}) and n_microbatches ({n_microbatches}) must be >= 1")
    num_stages, by_rank = stage_layout(pipeline_cfg, pp, num_layers)
    stages = [_stand_in(i, num_stages, pp) for i in by_rank[0]]
    try:
        return make_schedule(stages, pipeline_cfg, n_microbatches)
    except (ValueError, RuntimeError, AssertionError) as err:
        raise ValueError(f"{_name(pipeline_cfg)} with pp={pp}, {num_stages} stages, "
                         f"{n_microbatches} micro-batches: {err}") from err


def _name(pipeline_cfg) -> str:
    if pipeline_cfg.pp_schedule_csv is not None:
        return "csv"
    return canonical_schedule(pipeline_cfg.pp_schedule)


def schedule_timeline(pipeline_cfg, pp: int, n_microbatches: int, *,
                      num_layers: int | None = None,
                      weights: Mapping[str, float] | None = None,
                      stage_weights: Sequence[float] | None = None,
                      p2p: float = 0.0) -> Timeline:
    """The timeline of the schedule a run builds for ``pipeline_cfg`` on ``pp`` ranks with
    ``n_microbatches`` (see the module docstring). ``weights``: cost per action kind
    (overrides ``DEFAULT_WEIGHTS``); ``stage_weights``: a factor per stage; ``p2p``: the time
    a cross-rank dependency waits."""
    schedule = planned_schedule(pipeline_cfg, pp, n_microbatches, num_layers)
    return timeline_of_run(schedule, weights=weights, stage_weights=stage_weights, p2p=p2p,
                           name=_name(pipeline_cfg))


def timeline_of_run(schedule, *, weights: Mapping[str, float] | None = None,
                    stage_weights: Sequence[float] | None = None, p2p: float = 0.0,
                    name: str | None = None) -> Timeline:
    """The timeline of a torch schedule object: one a run instantiated (e.g.
    ``PipelineStep.schedule``) or ``planned_schedule``'s."""
    lowered = lowered_actions(schedule)
    ranks = sorted(lowered)
    order = [[a for a in lowered[r] if a[0] in COMPUTE] for r in ranks]
    if isinstance(schedule, PipelineScheduleSingle):
        order = [_as_stepped(acts) for acts in order]
    num_stages, n_mb = _check_order(order)
    cost = {**DEFAULT_WEIGHTS, **(weights or {})}
    if stage_weights is not None and len(stage_weights) != num_stages:
        raise ValueError(f"stage_weights has {len(stage_weights)} entries for "
                         f"{num_stages} stages")
    blocks = _simulate(order, num_stages, cost, stage_weights, p2p)
    makespan = max((b.start + b.duration for rank in blocks for b in rank), default=0.0)
    stages_by_rank = [sorted({s for _, s, _ in acts}) for acts in order]
    return Timeline(name or type(schedule).__name__, type(schedule).__name__, len(ranks),
                    n_mb, num_stages, stages_by_rank, blocks, makespan, cost,
                    [lowered[r] for r in ranks])


def _as_stepped(actions: list[tuple]) -> list[tuple]:
    """A single-stage schedule's order as its ``_step_microbatches`` runs it: the i-th
    forward (and the i-th backward) of the rank is micro-batch i."""
    seen: Counter = Counter()
    out = []
    for kind, stage, _ in actions:
        out.append((kind, stage, seen[kind]))
        seen[kind] += 1
    return out


def _check_order(order: list[list[tuple]]) -> tuple[int, int]:
    """(stage count, micro-batch count); ValueError unless every (stage, micro-batch) runs
    one F and one backward (B, or I and W), each once."""
    seen = Counter((k, s, m) for acts in order for k, s, m in acts)
    stages = {s for _, s, _ in seen}
    num_stages = max(stages, default=-1) + 1
    n_mb = max((m for _, _, m in seen), default=-1) + 1
    for s in range(num_stages):
        for m in range(n_mb):
            f, b, i, w = (seen[(k, s, m)] for k in COMPUTE)
            if (f, b + i, i) not in ((1, 1, 0), (1, 1, 1)) or w != i:
                raise ValueError(f"the schedule's action list runs stage {s}, micro-batch {m} "
                                 f"as F x{f}, B x{b}, I x{i}, W x{w} (expected F once and "
                                 "B once, or I and W once each)")
    return num_stages, n_mb


def _simulate(order, num_stages, cost, stage_weights, p2p) -> list[list[Block]]:
    """Earliest start for every action, keeping each rank's order."""
    rank_of = {s: r for r, acts in enumerate(order) for _, s, _ in acts}
    done: dict[tuple, float] = {}   # (kind, stage, mb) -> end time

    def after(key, stage):   # end of ``key`` (+ p2p across ranks); None until it has run
        end = done.get(key)
        if end is None and key[0] == "B":
            end = done.get(("I", *key[1:]))
        return None if end is None else end + (p2p if rank_of[key[1]] != rank_of[stage] else 0)

    def ready_at(kind, stage, mb):
        deps = []
        if kind == "F" and stage > 0:
            deps.append(after(("F", stage - 1, mb), stage))
        elif kind in ("B", "I"):
            deps.append(after(("F", stage, mb), stage))
            if stage < num_stages - 1:
                deps.append(after(("B", stage + 1, mb), stage))
        elif kind == "W":
            deps.append(after(("I", stage, mb), stage))
        return None if None in deps else max(deps, default=0.0)

    blocks: list[list[Block]] = [[] for _ in order]
    free, nxt = [0.0] * len(order), [0] * len(order)
    while any(n < len(acts) for n, acts in zip(nxt, order)):
        progress = False
        for r, acts in enumerate(order):
            while nxt[r] < len(acts):
                kind, stage, mb = acts[nxt[r]]
                ready = ready_at(kind, stage, mb)
                if ready is None:
                    break
                start = max(free[r], ready)
                duration = cost[kind] * (stage_weights[stage] if stage_weights else 1)
                free[r] = done[(kind, stage, mb)] = start + duration
                blocks[r].append(Block(start, duration, kind, stage, mb))
                nxt[r] += 1
                progress = True
        if not progress:
            stuck = {r: acts[nxt[r]] for r, acts in enumerate(order) if nxt[r] < len(acts)}
            raise ValueError(f"the schedule deadlocks; next action per rank: {stuck}")
    return blocks


def rank_bubbles(timeline: Timeline) -> list[float]:
    """Each rank's idle share of the makespan."""
    span = timeline.makespan
    return [(span - sum(b.duration for b in rank)) / span for rank in timeline.ranks]


def bubble_fraction(timeline: Timeline) -> float:
    """Idle time / (ranks x makespan)."""
    span, ranks = timeline.makespan, timeline.ranks
    busy = sum(b.duration for rank in ranks for b in rank)
    return (span * len(ranks) - busy) / (span * len(ranks))


def bubble_of_run(schedule, **kwargs) -> float:
    """``bubble_fraction`` of a torch schedule object a run built (``PipelineStep.schedule``
    on any rank: its action list covers every rank); ``kwargs`` as ``timeline_of_run``."""
    return bubble_fraction(timeline_of_run(schedule, **kwargs))


def _held(timeline: Timeline):
    """(stage, start of F, end of the action that releases the activations) per
    micro-batch and stage."""
    start, end = {}, {}
    for rank in timeline.ranks:
        for b in rank:
            key = (b.stage, b.microbatch)
            if b.kind == "F":
                start[key] = b.start
            elif b.kind in ("B", "W"):   # (I leaves the weight-grad inputs to W)
                end[key] = b.start + b.duration
    return [(key[0], start[key], end[key]) for key in start]


def _peak(intervals, weight=lambda _: 1) -> float:
    """Largest total weight of overlapping [start, end) intervals (ends before starts)."""
    events = [(t0, 1, s) for s, t0, _ in intervals] + [(t1, -1, s) for s, _, t1 in intervals]
    live = peak = 0
    for _, delta, stage in sorted(events, key=lambda e: (e[0], e[1])):
        live += delta * weight(stage)
        peak = max(peak, live)
    return peak


def in_flight(timeline: Timeline) -> list[int]:
    """Per pipeline stage (index = stage id): the most micro-batches whose activations the
    stage holds at once (forward started, backward not yet done; see the module docstring)."""
    held = _held(timeline)
    return [int(_peak([h for h in held if h[0] == s])) for s in range(timeline.num_stages)]


def rank_in_flight(timeline: Timeline,
                   stage_bytes: Sequence[float] | None = None) -> list[float]:
    """Per pp rank: the peak over time of the sum, over its stages, of the micro-batches
    held times ``stage_bytes[stage]`` (default 1: micro-batch-stages). With several stages
    per rank this is at most, and can be below, the sum of the stages' ``in_flight``."""
    held = _held(timeline)
    weight = (lambda s: stage_bytes[s]) if stage_bytes is not None else (lambda s: 1)
    return [_peak([h for h in held if h[0] in stages], weight)
            for stages in timeline.stages_by_rank]
