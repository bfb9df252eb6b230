"""The pipeline bubble and in-flight micro-batches from torch's own schedule objects
(``automodel/distributed/pipelining/bubble.py``): closed forms where they hold exactly,
regression values, CSV schedules, and the schedule a real run on gloo ranks built and ran."""

from fractions import Fraction

import pytest

from automodel.config.schema import PipelineConfig
from automodel.distributed.pipelining.bubble import (
    bubble_fraction,
    bubble_of_run,
    in_flight,
    planned_schedule,
    rank_in_flight,
    schedule_timeline,
    timeline_of_run,
)
from tests.helpers import BASE, run_on_ranks, write_schedule_csv


def _exact(x: float) -> Fraction:
    return Fraction(x).limit_denominator(10_000)


def _interleaved(name: str = "interleaved_1f1b") -> PipelineConfig:
    """A loop schedule with one layer per stage: ``num_layers = v * pp`` sets v."""
    return PipelineConfig(pp_schedule=name, layers_per_stage=1)


@pytest.mark.fast
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (3, 7), (8, 8)])
def test_single_stage_schedules_match_the_closed_forms(name, pp, m):
    """(p - 1) / (m + p - 1) whatever a backward costs; in flight: 1F1B min(p - stage, m),
    GPipe m."""
    for b in (1, 2, 3):
        tl = schedule_timeline(PipelineConfig(pp_schedule=name), pp, m, weights={"B": b})
        assert _exact(bubble_fraction(tl)) == Fraction(pp - 1, m + pp - 1)
        assert tl.makespan == (m + pp - 1) * (1 + b)
    expected = [m] * pp if name == "gpipe" else [min(pp - s, m) for s in range(pp)]
    assert in_flight(tl) == expected
    assert rank_in_flight(tl) == expected  # one stage per rank


@pytest.mark.fast
def test_interleaved_matches_its_closed_form_where_it_is_exact():
    """(p - 1) / (v m + p - 1) for interleaved 1F1B and looped BFS when m >= p, whatever B
    costs; below p micro-batches torch's interleaved order idles more than that."""
    for name in ("interleaved_1f1b", "looped_bfs"):
        for pp, v, m in [(2, 2, 2), (2, 3, 3), (3, 2, 6), (3, 3, 4), (4, 2, 8), (4, 3, 5)]:
            for b in (1, 2):
                tl = schedule_timeline(_interleaved(name), pp, m, num_layers=v * pp,
                                       weights={"B": b})
                assert tl.num_stages == v * pp
                assert _exact(bubble_fraction(tl)) == Fraction(pp - 1, v * m + pp - 1), \
                    (name, pp, v, m, b)
    few = schedule_timeline(_interleaved(), 4, 2, num_layers=8)
    assert bubble_fraction(few) > (4 - 1) / (2 * 2 + 4 - 1)


@pytest.mark.fast
def test_regression_values_pp4_m8_v2():
    """Every action one unit (B = 1). The measured facts (planning-facts.md section 5) come
    from torch's visualizer grid (``get_schedule_ops(add_spacing=True)``), which counts one
    slot per action although it times a full B as 2 and an OVERLAP_F_B as 3: it agrees with
    the timing only for ZBVZeroBubble (every action one unit, no overlap)."""
    unit = {"B": 1}
    got = {name: bubble_fraction(schedule_timeline(PipelineConfig(pp_schedule=name), 4, 8,
                                                   weights=unit))
           for name in ("interleaved_1f1b", "v_schedule", "dualpipev", "zero_bubble")}
    assert _exact(got["interleaved_1f1b"]) == Fraction(3, 19)  # = (p-1)/(vm+p-1)
    assert round(got["v_schedule"], 3) == 0.059                 # the fact
    assert _exact(got["v_schedule"]) == Fraction(3, 51)
    assert _exact(got["zero_bubble"]) == Fraction(3, 51)
    assert _exact(got["dualpipev"]) == Fraction(1, 26)
    grid = _visualizer_grid_bubbles()
    assert grid == {"Interleaved1F1B": 0.22, "ZBVZeroBubble": 0.059, "DualPipeV": 0.219}


def _visualizer_grid_bubbles() -> dict:
    """Idle slots / all slots of torch's spaced visualizer grid (how the facts were taken)."""
    import contextlib
    import io

    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    out = {}
    for name in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"):
        with contextlib.redirect_stdout(io.StringIO()):  # (it prints every step)
            ops = get_schedule_ops(name, 4, 8, 2, add_spacing=True)
        slots = len(ops) * max(len(r) for r in ops)
        out[name] = round(1 - sum(a is not None for r in ops for a in r) / slots, 3)
    return out


@pytest.mark.fast
def test_in_flight_of_multi_stage_schedules():
    """Interleaved 1F1B: each rank's warm-up forwards (v - 1) p + 2 (p - 1 - r) (Megatron's
    count) plus the steady state's first forward, in stage micro-batches; a split backward
    holds a micro-batch until its W."""
    pp, v = 4, 2
    tl = schedule_timeline(_interleaved(), pp, 8, num_layers=v * pp)
    assert rank_in_flight(tl) == [(v - 1) * pp + 2 * (pp - 1 - r) + 1 for r in range(pp)]
    assert in_flight(tl) == [8, 8, 7, 5, 4, 4, 3, 1]
    # weighted by bytes per stage: stage s of rank r weighs s + 1
    sizes = [s + 1 for s in range(2 * pp)]
    assert rank_in_flight(tl, sizes)[0] <= 8 * 1 + 4 * 5
    zbv = schedule_timeline(PipelineConfig(pp_schedule="v_schedule"), pp, 8)
    assert tl.stages_by_rank[0] == [0, 4] and zbv.stages_by_rank[0] == [0, 7]
    assert in_flight(zbv) == [8, 7, 6, 5, 4, 3, 2, 1]
    released_at_i = {b.microbatch: b.start + b.duration for b in zbv.ranks[3] if b.kind == "I"}
    released_at_w = {b.microbatch: b.start + b.duration for b in zbv.ranks[3] if b.kind == "W"}
    assert any(released_at_w[k] > released_at_i[k] for k in released_at_i)


@pytest.mark.fast
def test_costs_per_stage_and_point_to_point_delay():
    cfg = PipelineConfig(pp_schedule="1f1b")
    base = schedule_timeline(cfg, 4, 8)
    doubled = schedule_timeline(cfg, 4, 8, stage_weights=[2] * 4)
    assert doubled.makespan == 2 * base.makespan
    assert bubble_fraction(doubled) == pytest.approx(bubble_fraction(base))
    # a heavy last stage makes every other rank wait
    assert bubble_fraction(schedule_timeline(cfg, 4, 8, stage_weights=[1, 1, 1, 2])) > \
        bubble_fraction(base)
    slow = schedule_timeline(cfg, 4, 8, p2p=0.5)
    ends = {(b.kind, b.stage, b.microbatch): b.start + b.duration
            for rank in slow.ranks for b in rank}
    for rank in slow.ranks:
        for b in rank:
            if b.kind == "F" and b.stage > 0:
                assert b.start >= ends[("F", b.stage - 1, b.microbatch)] + 0.5
    # at least the fill and the drain each wait (p - 1) hops
    assert slow.makespan >= base.makespan + 2 * 3 * 0.5
    assert bubble_fraction(slow) > bubble_fraction(base)
    with pytest.raises(ValueError, match="stage_weights has 3 entries for 4 stages"):
        schedule_timeline(cfg, 4, 8, stage_weights=[1, 1, 1])


@pytest.mark.fast
@pytest.mark.parametrize("comms", [False, True], ids=["compute_only", "compute_comms"])
def test_csv_schedule_is_timed_from_its_own_rows(comms, tmp_path):
    """``pipeline.pp_schedule_csv`` (looped breadth-first rows, through torch's CSV runtime):
    each rank runs its row's compute cells in order, with the built-in looped_bfs's bubble
    (torch's runs the backwards in the reverse micro-batch order)."""
    path = write_schedule_csv(tmp_path / "s.csv", 2, 4, stages_per_rank=2, comms=comms)
    tl = schedule_timeline(PipelineConfig(pp_schedule="csv", pp_schedule_csv=path), 2, 4)
    rows = [line.strip().split(",") for line in open(path, encoding="utf-8")]
    cells = [[c for c in row if c[1] in "FB" and c[2:].isdigit()] for row in rows]
    assert [[f"{b.stage}{b.kind}{b.microbatch}" for b in r] for r in tl.ranks] == cells
    bfs = schedule_timeline(_interleaved("looped_bfs"), 2, 4, num_layers=4)
    assert tl.name == "csv" and tl.stages_by_rank == bfs.stages_by_rank == [[0, 2], [1, 3]]
    assert bubble_fraction(tl) == bubble_fraction(bfs) == pytest.approx(1 / 9)
    kinds = {k for rank in tl.lowered for k, _, _ in rank}
    assert {"SEND_F", "RECV_F", "SEND_B", "RECV_B"} <= kinds


@pytest.mark.fast
def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"1f1b with pp=4, 4 stages, 2 micro-batches: "
                                         r"Number of microbatches"):
        schedule_timeline(PipelineConfig(pp_schedule="1f1b"), 4, 2)
    with pytest.raises(ValueError, match="pass num_layers"):
        schedule_timeline(_interleaved(), 4, 8)
    with pytest.raises(ValueError, match="n_microbatches"):
        planned_schedule(PipelineConfig(), 2, 0)


# --------------------------------------------------------------------------- a real run
CONFIGS = {  # pp = 2 on 2 ranks; 8 sequences in micro-batches of 2: m = 4
    "1f1b": ["pipeline=1f1b"],
    "interleaved": ["pipeline=interleaved"],
    "v_schedule": ["pipeline=v_schedule"],
}


def _record_order(stages, log: list) -> None:
    """Log each compute call of these ``PipelineStage`` objects as (kind, stage, mb)."""
    from benchmarks.plan_accuracy import record_compute_calls

    record_compute_calls(stages, log)


def _run_schedules(rank, world, configs):
    """One optimizer step per config: the compute calls this rank made, in order, and the
    timeline and bubble of the schedule object the step ran."""
    import warnings

    import torch

    from automodel.api import load_config
    from automodel.compat import stages_of
    from automodel.data.batches import BatchPlan
    from automodel.data.sources import training_data
    from automodel.distributed.init import DistInfo
    from automodel.parallelize import parallelize
    from automodel.recipes import components
    from automodel.recipes import train as runner
    from automodel.recipes.pipeline_step import PipelineStep

    warnings.filterwarnings("ignore")
    out = {}
    for name, overrides in configs.items():
        cfg = load_config(BASE + [f"distributed.nproc_per_node={world}",
                                  "pipeline.pp_microbatch_size=2"] + overrides)
        info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
        setup = runner.build_setup(cfg, info)
        model, fill = components.initial_model(cfg, info)
        parallel = parallelize(model, setup, fill)
        t = cfg.trainer
        rows, _ = training_data(cfg.data_source, cfg.data, t.seq_len, cfg.model)
        batches = BatchPlan(rows, t.global_batch_size, t.seed).micro_batches(
            0, setup.dp_rank, setup.dp_size, t.local_batch_size)
        step = PipelineStep(parallel, setup, t.global_batch_size // setup.dp_size)
        ran: list = []
        _record_order(stages_of(step.schedule), ran)
        step(batches, cfg.optim.max_grad_norm)
        tl = timeline_of_run(step.schedule)
        out[name] = {"ran": ran, "bubble": bubble_of_run(step.schedule),
                     "order": [[(b.kind, b.stage, b.microbatch) for b in r] for r in tl.ranks],
                     "pipeline": cfg.pipeline, "pp": setup.layout.pp,
                     "m": step.n_microbatches}
    return out


def test_the_plan_times_the_schedule_a_run_built_and_ran(tmp_path):
    """On 2 gloo ranks: each rank ran exactly the compute order read from its schedule
    object, and the bubble of that object equals the plan's for the same config."""
    ranks = run_on_ranks(_run_schedules, 2, CONFIGS, tmp_path=tmp_path)
    for name in CONFIGS:
        got = [r[name] for r in ranks]
        first = got[0]
        assert first["m"] == 4 and first["pp"] == 2
        planned = schedule_timeline(first["pipeline"], 2, first["m"])
        plan_order = [[(b.kind, b.stage, b.microbatch) for b in r] for r in planned.ranks]
        for rank, r in enumerate(got):
            assert r["order"] == plan_order, name       # every rank's object: all ranks
            assert r["ran"] == plan_order[rank], name   # what this rank really ran
            assert r["bubble"] == bubble_fraction(planned)
    kinds = {k for k, _, _ in ranks[0]["v_schedule"]["ran"]}
    assert kinds == {"F", "I", "W"}  # (a split backward really ran)
