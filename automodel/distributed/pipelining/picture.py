"""Draw a pipeline schedule (ranks x time) and report its bubble fraction, on CPU only.

    python -m automodel.distributed.pipelining.picture --schedule 1f1b --pp-size 4 \
        --microbatches 8 --out schedule.png

The timeline is ``bubble.py``'s (the one home of the rule): the torch
schedule a run builds for that schedule name, its lowered action list, each action placed
as early as its inputs allow, with costs F = I = W = 1 unit and a full backward B = 2 (see
that module's docstring). A unit is one *stage's* forward, so with v stages per rank it is
1/v of a single-stage schedule's unit: compare bubble fractions, not makespans, across stage
counts. Bubble fraction = idle / (busy + idle) over the makespan, per rank and over all
ranks; for GPipe and 1F1B it is exactly (pp - 1) / (m + pp - 1).
"""

from __future__ import annotations

import argparse
import sys

from automodel.config.schema import PipelineConfig
from automodel.distributed.pipelining import bubble
from automodel.distributed.pipelining.bubble import DEFAULT_WEIGHTS as DURATIONS
from automodel.distributed.pipelining.bubble import Block, Timeline
from automodel.distributed.pipelining.schedule import SCHEDULES, schedule_spec

KIND_NAMES = {"F": "forward", "B": "backward (full)", "I": "backward (input grad)",
              "W": "backward (weight grad)"}
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#55A868", "W": "#8172B3"}


def _stages_per_rank(name: str, stages_per_rank: int | None) -> int:
    try:
        spec = schedule_spec(name)
    except ValueError:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)} "
                         "(or torch's class names, e.g. Interleaved1F1B)") from None
    if not spec.multi_stage:
        if stages_per_rank not in (None, 1):
            raise ValueError(f"{name} runs one stage per rank, not {stages_per_rank}")
        return 1
    if spec.v_placement:
        if stages_per_rank not in (None, 2):
            raise ValueError(f"{name} is a V schedule: it needs exactly 2 stages per rank "
                             f"(2 * pp_size stages), not {stages_per_rank}")
        return 2
    if stages_per_rank is not None and stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
    return stages_per_rank or 2


def schedule_timeline(schedule_name: str, pp_size: int, n_microbatches: int, *,
                      stages_per_rank: int | None = None,
                      durations: dict[str, float] | None = None) -> Timeline:
    """Simulated timeline of ``schedule_name`` on ``pp_size`` ranks. ``stages_per_rank``
    defaults to 1 for 1f1b/gpipe and 2 otherwise; ``durations`` overrides ``DURATIONS``."""
    per_rank = _stages_per_rank(schedule_name, stages_per_rank)
    # a config with one layer per stage places exactly ``per_rank`` stages on each rank
    cfg = PipelineConfig(pp_schedule=schedule_name, layers_per_stage=1)
    return bubble.schedule_timeline(cfg, pp_size, n_microbatches,
                                    num_layers=per_rank * pp_size, weights=durations)


def bubble_fraction(timeline: Timeline) -> tuple[float, list[float]]:
    """(overall, per rank) share of idle time over the makespan."""
    return bubble.bubble_fraction(timeline), bubble.rank_bubbles(timeline)


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
    ax.set_title(f"{timeline.name} ({timeline.schedule_class}): pp={pp}, "
                 f"{timeline.num_stages} stages, "
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
    return timeline.weights != DURATIONS


def summary(timeline: Timeline) -> str:
    overall, per_rank = bubble_fraction(timeline)
    ranks = ", ".join(f"{x:.1%}" for x in per_rank)
    return (f"{timeline.name}, pp={timeline.pp_size}, {timeline.n_microbatches} "
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
