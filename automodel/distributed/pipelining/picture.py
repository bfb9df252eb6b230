"""Draw a pipeline schedule (ranks x time) and report its bubble fraction, on CPU only.

    python -m automodel.distributed.pipelining.picture --schedule 1f1b --pp-size 4 \
        --microbatches 8 --out schedule.png

How the picture is made, without any process group:

1. Per-rank action order. The multi-stage schedules compute ``pipeline_order`` (rank -> list
   of ``_Action``) in ``__init__`` from the stages' ``num_stages``, ``stage_index``,
   ``group_rank`` and ``group_size`` alone (``submod`` is only checked for torch.compile), so
   we build them with tiny stand-in stage objects. DualPipeV's ``OVERLAP_F_B`` actions are
   split into their sub-actions, which torch's runtime runs one after the other unless a
   custom overlap function is registered. The single-stage schedules are constructed too
   (so torch's argument checks run), but their order is written out here, as their ``step``
   runs it (torch 2.13's ``Schedule1F1B.pipeline_order`` is only illustrative and gives the
   last rank micro-batches 1..m instead of 0..m-1):
     GPipe: every forward, then every backward, in micro-batch order.
     1F1B:  rank r runs min(m, pp - r) forwards, then alternates backward and forward, then
            the remaining backwards.
2. Timing. Each rank runs its actions in that order; an action starts once the rank is free
   and its inputs exist: F(s, m) after F(s-1, m); B or I (input grad) of (s, m) after F(s, m)
   and after B/I of (s+1, m); W (weight grad) of (s, m) after I(s, m). Communication is free.
   Costs (``DURATIONS``): F = I = W = 1 unit and a full backward B = 2 (= I + W): backward
   costs twice a forward, and F = I = W is what the zero-bubble schedules are designed for.
   A unit is one *stage's* forward, so with v stages per rank it is 1/v of a single-stage
   schedule's unit: compare bubble fractions, not makespans, across stage counts.
3. Bubble fraction = idle / (busy + idle) over the makespan (time 0 to the last action's
   end), per rank and over all ranks. Every rank does the same work here, so the per-rank
   values agree. For GPipe and 1F1B this model gives exactly (pp - 1) / (m + pp - 1).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

from torch.distributed.pipelining import schedules as S

from automodel.distributed.pipelining.schedule import SCHEDULES, schedule_spec, stages_of_rank

# time units per action kind (see the module docstring)
DURATIONS = {"F": 1, "I": 1, "W": 1, "B": 2}
KIND_NAMES = {"F": "forward", "B": "backward (full)", "I": "backward (input grad)",
              "W": "backward (weight grad)"}
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#55A868", "W": "#8172B3"}


class Block(NamedTuple):
    """One action on one rank: it runs over [start, start + duration)."""
    start: float
    duration: float
    kind: str        # "F", "B", "I" or "W"
    stage: int
    microbatch: int


@dataclass
class Timeline:
    schedule: str
    pp_size: int
    n_microbatches: int
    num_stages: int
    ranks: list[list[Block]]   # ranks[r]: rank r's blocks in start order
    makespan: float


def _torch_order(name: str, pp_size: int, n_microbatches: int, stages_per_rank: int | None):
    """(per-rank list of (kind, stage, microbatch) in run order, total stage count)."""
    try:
        spec = schedule_spec(name)
    except ValueError:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)} "
                         "(or torch's class names, e.g. Interleaved1F1B)") from None
    if pp_size < 1 or n_microbatches < 1:
        raise ValueError(f"pp_size ({pp_size}) and n_microbatches ({n_microbatches}) "
                         "must be >= 1")
    if not spec.multi_stage:
        if stages_per_rank not in (None, 1):
            raise ValueError(f"{name} runs one stage per rank, not {stages_per_rank}")
        per_rank = 1
    elif spec.v_placement:
        if stages_per_rank not in (None, 2):
            raise ValueError(f"{name} is a V schedule: it needs exactly 2 stages per rank "
                             f"(2 * pp_size stages), not {stages_per_rank}")
        per_rank = 2
    else:
        per_rank = 2 if stages_per_rank is None else stages_per_rank
        if per_rank < 1:
            raise ValueError(f"stages_per_rank must be >= 1, got {per_rank}")
    num_stages = per_rank * pp_size

    # Stand-ins for PipelineStage with only what the schedules' __init__ reads. Rank 0's
    # stages are enough: torch computes the order of every rank from any one of them.
    def stand_in(index: int):
        return SimpleNamespace(num_stages=num_stages, stage_index=index, group_rank=0,
                               group_size=pp_size, submod=None, is_first=index == 0,
                               is_last=index == num_stages - 1)
    mine = stages_of_rank(0, pp_size, num_stages, spec.v_placement)
    try:
        if spec.multi_stage:
            sched = spec.cls([stand_in(i) for i in mine], n_microbatches=n_microbatches)
        else:
            sched = spec.cls(stand_in(0), n_microbatches=n_microbatches)
    except (ValueError, RuntimeError, AssertionError) as err:
        raise ValueError(f"{name} ({spec.cls.__name__}) with pp_size={pp_size}, "
                         f"{num_stages} stages, {n_microbatches} micro-batches: {err}") from err

    if not spec.multi_stage:
        return [_textbook_order(spec.cls, r, pp_size, n_microbatches)
                for r in range(pp_size)], num_stages

    compute = {"F", "B", "I", "W"}
    order = []
    for rank in range(pp_size):
        acts = []
        for a in sched.pipeline_order[rank]:
            if a is None:
                continue   # torch's idle placeholders; our simulation finds the idle time
            for sub in (a.sub_actions or (a,)):   # OVERLAP_F_B -> its F and B, in order
                kind = sub.computation_type.value
                if kind in compute:
                    acts.append((kind, sub.stage_index, sub.microbatch_index))
        order.append(acts)
    return order, num_stages


def _textbook_order(cls, rank: int, pp_size: int, m: int):
    """GPipe or 1F1B order for one rank (stage = rank)."""
    if cls is S.ScheduleGPipe:
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    warmup = min(m, pp_size - rank)
    acts = [("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):   # steady state: one backward, one forward
        acts += [("B", rank, i), ("F", rank, warmup + i)]
    acts += [("B", rank, i) for i in range(m - warmup, m)]
    return acts


def _simulate(order, num_stages: int, durations: dict[str, float]) -> list[list[Block]]:
    """Earliest start for every action, keeping each rank's order (see module docstring)."""
    done: dict[tuple[str, int, int], float] = {}   # (kind, stage, mb) -> end time

    def grad_end(stage, mb):   # when the input grad of (stage, mb) exists, else None
        return done.get(("B", stage, mb), done.get(("I", stage, mb)))

    def ready_at(kind, stage, mb):   # None while a dependency has not run yet
        deps = []
        if kind == "F":
            deps = [done.get(("F", stage - 1, mb))] if stage > 0 else []
        elif kind in ("B", "I"):
            deps = [done.get(("F", stage, mb))]
            if stage < num_stages - 1:
                deps.append(grad_end(stage + 1, mb))
        elif kind == "W":
            deps = [done.get(("I", stage, mb))]
        return None if None in deps else max(deps, default=0)

    blocks = [[] for _ in order]
    free = [0.0] * len(order)   # when each rank finishes its last placed action
    nxt = [0] * len(order)
    while any(n < len(acts) for n, acts in zip(nxt, order)):
        progress = False
        for r, acts in enumerate(order):
            while nxt[r] < len(acts):
                kind, stage, mb = acts[nxt[r]]
                ready = ready_at(kind, stage, mb)
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = start + durations[kind]
                done[(kind, stage, mb)] = free[r]
                blocks[r].append(Block(start, durations[kind], kind, stage, mb))
                nxt[r] += 1
                progress = True
        if not progress:
            stuck = {r: acts[nxt[r]] for r, acts in enumerate(order) if nxt[r] < len(acts)}
            raise RuntimeError(f"schedule deadlocks; next action per rank: {stuck}")
    return blocks


def schedule_timeline(schedule_name: str, pp_size: int, n_microbatches: int, *,
                      stages_per_rank: int | None = None,
                      durations: dict[str, float] | None = None) -> Timeline:
    """Simulated timeline of ``schedule_name`` on ``pp_size`` ranks. ``stages_per_rank``
    defaults to 1 for 1f1b/gpipe and 2 otherwise; ``durations`` overrides ``DURATIONS``."""
    order, num_stages = _torch_order(schedule_name, pp_size, n_microbatches, stages_per_rank)
    blocks = _simulate(order, num_stages, {**DURATIONS, **(durations or {})})
    makespan = max((b.start + b.duration for rank in blocks for b in rank), default=0)
    return Timeline(schedule_name, pp_size, n_microbatches, num_stages, blocks, makespan)


def bubble_fraction(timeline: Timeline) -> tuple[float, list[float]]:
    """(overall, per rank) share of idle time over the makespan."""
    span = timeline.makespan
    busy = [sum(b.duration for b in rank) for rank in timeline.ranks]
    per_rank = [(span - x) / span for x in busy]
    overall = (span * len(busy) - sum(busy)) / (span * len(busy))
    return overall, per_rank


def _idle_gaps(blocks: list[Block], makespan: float):
    """(start, length) of each idle stretch of one rank."""
    gaps, t = [], 0.0
    for b in blocks + [Block(makespan, 0, "", -1, -1)]:
        if b.start > t:
            gaps.append((t, b.start - t))
        t = max(t, b.start + b.duration)
    return gaps


def draw(timeline: Timeline, path: str) -> str:
    """Draw ``timeline`` to a PNG at ``path`` (rank 0 at the top) and return ``path``."""
    import matplotlib
    matplotlib.use("Agg")   # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span, pp = timeline.makespan, timeline.pp_size
    unit_w = 0.42   # inches per time unit: room for a two-line "F0 / s1" label
    height = 1.6 + 0.75 * pp
    fig, ax = plt.subplots(figsize=(max(8, span * unit_w + 2), height))
    for r, blocks in enumerate(timeline.ranks):
        for start, length in _idle_gaps(blocks, span):   # bubbles: hatched, empty
            ax.add_patch(plt.Rectangle((start, r - 0.4), length, 0.8, facecolor="white",
                                       edgecolor="#BBBBBB", hatch="///", linewidth=0.5))
        for b in blocks:
            ax.add_patch(plt.Rectangle((b.start, r - 0.4), b.duration, 0.8,
                                       facecolor=COLOURS[b.kind], edgecolor="black",
                                       linewidth=0.6))
            sep = " " if b.duration >= 2 else "\n"
            ax.text(b.start + b.duration / 2, r, f"{b.kind}{b.microbatch}{sep}s{b.stage}",
                    ha="center", va="center", fontsize=7, color="white", fontweight="bold")
    ax.set_xlim(0, span)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_xlabel("time (units: F = I = W = 1, full backward B = 2; communication free)"
                  if not _custom_durations(timeline) else "time")
    ax.set_xticks(range(0, int(span) + 1, 1 if span <= 40 else 5))
    ax.grid(axis="x", linestyle=":", linewidth=0.5, alpha=0.6)
    ax.set_axisbelow(True)
    overall, _ = bubble_fraction(timeline)
    cls = schedule_spec(timeline.schedule).cls.__name__
    ax.set_title(f"{timeline.schedule} ({cls}): pp={pp}, {timeline.num_stages} stages, "
                 f"{timeline.n_microbatches} micro-batches; bubble {overall:.1%}")
    kinds = sorted({b.kind for rank in timeline.ranks for b in rank}, key="FBIW".index)
    handles = [Patch(facecolor=COLOURS[k], edgecolor="black", label=KIND_NAMES[k])
               for k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="#BBBBBB", hatch="///",
                         label="idle (bubble)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1))   # leave a strip for the legend
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _custom_durations(timeline: Timeline) -> bool:
    """Whether the blocks use costs other than ``DURATIONS``."""
    return any(b.duration != DURATIONS[b.kind] for rank in timeline.ranks for b in rank)


def summary(timeline: Timeline) -> str:
    overall, per_rank = bubble_fraction(timeline)
    ranks = ", ".join(f"{x:.1%}" for x in per_rank)
    return (f"{timeline.schedule}, pp={timeline.pp_size}, {timeline.n_microbatches} "
            f"micro-batches: bubble fraction {overall:.1%} (per rank: {ranks}; makespan "
            f"{timeline.makespan:g} units, {timeline.num_stages} stages)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m automodel.distributed.pipelining.picture",
        description="Draw a pipeline schedule to a PNG and print its bubble fraction.")
    parser.add_argument("--schedule", default="1f1b",
                        help=f"one of {', '.join(SCHEDULES)} (or torch's class names)")
    parser.add_argument("--pp-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages-per-rank", type=int, default=None,
                        help="multi-stage loop schedules only (default 2)")
    parser.add_argument("--out", default=None,
                        help="PNG path (default: pipeline_<schedule>_pp<P>_m<M>.png)")
    args = parser.parse_args(argv)
    try:
        timeline = schedule_timeline(args.schedule, args.pp_size, args.microbatches,
                                     stages_per_rank=args.stages_per_rank)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    out = args.out or f"pipeline_{args.schedule}_pp{args.pp_size}_m{args.microbatches}.png"
    draw(timeline, out)
    print(summary(timeline))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
