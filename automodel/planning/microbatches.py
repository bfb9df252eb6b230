"""Simulating a pipeline of many micro-batches from two short runs of its schedule.

A pipelined rank's simulation costs time in proportion to the micro-batches its schedule runs
(times the layers it holds): 64 micro-batches of Llama-3.1-70B's 512-rank plan took 125 s
against 38 s for 16. But a schedule repeats itself: after its warm-up every further
micro-batch adds the same work (one forward and one backward of each stage the rank holds,
their sends and receives) and the same bytes to the peak (its input batch, held all step, and
the receive buffers torch's stages make for every micro-batch up front: three activations a
micro-batch on an interleaved rank, 403 MB for the 70B at seq 8192), while the micro-batches
in flight stay bounded by the schedule. So a rank class is simulated at two counts past the
warm-up, ``(v + 1) pp`` and ``(v + 2) pp`` micro-batches (``v`` stages a rank: 1F1B 2 pp and 3
pp, interleaved with two stages a rank 3 pp and 4 pp), and every number of the simulation
(FLOPs, bytes per axis, calls, memory) is extended along the line through the two to the
job's count, as ``depth.py`` extends layers. Closer to the warm-up the peak lay below the line:
1F1B at pp micro-batches; the 70B's interleaved rank 0 at 2 pp (436 MB a micro-batch from 8
to 12, then 403 on every step to 24).

A model cut in depth too (``depth.py``) would take four runs a class, two depths at each count;
the deeper depth's run at the larger count, the longest, is made of the other three and a run
of the deeper depth at one round of ``pp`` micro-batches (``corner``), a quarter less work
(the 70B at 28 micro-batches: 46 s instead of 58). Used for the schedules whose steady state is
known (1f1b and interleaved 1f1b; the latter only where the count is a multiple of ``pp``, which
keeps its rounds of ``pp`` micro-batches), with one schedule run a step (no
``pipeline.pp_batch_size``), and where the short runs cost less than the whole schedule
(``plan.planned_runs``). ``tests/planning/test_microbatches.py`` checks the extension against
the whole schedule's simulation; ``plan.full_depth=true`` simulates every micro-batch (and
layer).
"""

from __future__ import annotations

import dataclasses

from automodel.config.resolve import TrainConfig
from automodel.planning.depth import combine

SCHEDULES = ("1f1b", "interleaved_1f1b")  # schedules whose steady state the line holds for
# what a simulated step counts (sums over its operators: affine in the micro-batches from the
# first round of ``pp``); the rest of a simulation is memory
COUNTED = ("flops", "comm", "comm_calls")


def microbatch_pair(cfg: TrainConfig) -> tuple[int, int, int] | None:
    """(the two short counts, the job's count) of ``cfg``'s pipeline where the shortcut
    applies, else None."""
    p = cfg.pipeline
    if p is None or p.pp_schedule not in SCHEDULES or p.pp_batch_size is not None \
            or p.pp_schedule_csv:
        return None
    from automodel.planning.depth import stage_count

    pp = cfg.layout.pp
    v = stage_count(cfg) // pp
    batch = cfg.layout.per_rank_batch(cfg.trainer.global_batch_size)
    n = batch // p.pp_microbatch_size
    first, second = (v + 1) * pp, (v + 2) * pp
    if n <= second or (p.pp_schedule == "interleaved_1f1b" and n % pp):
        return None
    return first, second, n


def with_microbatches(cfg: TrainConfig, count: int) -> TrainConfig:
    """``cfg`` with its global batch cut so that each pipeline runs ``count`` micro-batches."""
    t, p = cfg.trainer, cfg.pipeline
    batch = count * p.pp_microbatch_size
    full = cfg.layout.per_rank_batch(t.global_batch_size)
    local = t.local_batch_size
    if local is not None:
        local = max(1, local * batch // full)
    trainer = dataclasses.replace(t, global_batch_size=batch * cfg.layout.dp,
                                  local_batch_size=local)
    return dataclasses.replace(cfg, trainer=trainer)


def few_microbatches(cfg: TrainConfig) -> int:
    """The count of the deeper depth's cheap run (``corner``): one round of ``pp``."""
    return cfg.layout.pp


def corner(near: dict, deep: dict, far: dict, deep_few: dict, counts: tuple[int, int],
           few: int) -> dict:
    """The simulation of the deeper of two depths at the larger of two counts (``counts``), from
    the other three corners (``near``: shallow at the smaller count, ``deep``: deeper at the
    smaller, ``far``: shallow at the larger) and the deeper depth at ``few`` micro-batches.

    What the step counts (``COUNTED``) is affine in the micro-batches at any depth: along the
    line through ``deep_few`` and ``deep``. The memory is ``far``'s plus what the deeper depth
    adds at the smaller count: a layer's parameters, gradients and states, and the activations
    of the micro-batches in flight, which the schedule's steady state bounds; what grows with
    the count (the input batches, the receive buffers) does not grow with the layers. Exact on
    the layouts of ``tests/planning/test_microbatches.py``; it saves a quarter of the four
    runs' work (the deeper depth's run at the larger count is the longest)."""
    n0, n1 = counts
    out = {}
    for key, value in near.items():
        if key in COUNTED:
            out[key] = combine(lambda d, f: d + (d - f) * (n1 - n0) / (n0 - few),
                               deep[key], deep_few[key])
        else:
            out[key] = combine(lambda f, d, n: f + d - n, far[key], deep[key], value)
    return out

