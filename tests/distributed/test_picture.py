"""The schedule picture: simulated timelines, bubble fractions, PNGs, CLI (no processes)."""

import subprocess
import sys
from collections import Counter
from fractions import Fraction

import pytest
import torch.distributed as dist

from automodel.distributed.pipelining import picture
from automodel.distributed.pipelining.picture import bubble_fraction, draw, schedule_timeline
from automodel.distributed.pipelining.schedule import SCHEDULES

# fast: no process group (the fixture below refuses one), seconds (pytest -m fast); the
# command line's test starts a fresh interpreter that imports torch, so runs in the full tier

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _no_process_group(monkeypatch):
    """Any attempt to start a process group fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the schedule picture must not start a process group")
    monkeypatch.setattr(dist, "init_process_group", refuse)


def _peak_in_flight(timeline):
    """Per rank: most micro-batches whose forward has started but whose input-grad
    backward (B or I) has not yet finished, i.e. the activations held at once."""
    peaks = []
    for blocks in timeline.ranks:
        events = [(b.start, 1) for b in blocks if b.kind == "F"]
        events += [(b.start + b.duration, -1) for b in blocks if b.kind in ("B", "I")]
        live = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # frees before starts
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


@pytest.mark.fast
def test_gpipe_bubble_is_textbook():
    # Unit model: F = 1, B = 2. Rank r forwards over [r, r + m); the last rank's backwards
    # run back to back from m + pp - 1, and each earlier rank ends 2 later, so the makespan
    # is (m + pp - 1) + 2m + 2(pp - 1) = 3(m + pp - 1) while each rank is busy 3m:
    # bubble = 3(pp - 1) / 3(m + pp - 1) = (pp - 1) / (m + pp - 1) = 1/5 for pp=2, m=4.
    pp, m = 2, 4
    tl = schedule_timeline("gpipe", pp, m)
    assert tl.makespan == 3 * (m + pp - 1) == 15
    overall, per_rank = bubble_fraction(tl)
    expected = Fraction(pp - 1, m + pp - 1)
    assert Fraction(overall).limit_denominator(1000) == expected
    assert per_rank == pytest.approx([float(expected)] * pp)


@pytest.mark.fast
@pytest.mark.parametrize("durations", [None, {"B": 1}], ids=["B=2F", "B=F"])
def test_1f1b_same_bubble_as_gpipe_but_bounded_activations(durations):
    pp, m = 4, 8
    one_f_one_b = schedule_timeline("1f1b", pp, m, durations=durations)
    gpipe = schedule_timeline("gpipe", pp, m, durations=durations)
    assert bubble_fraction(one_f_one_b)[0] == pytest.approx(bubble_fraction(gpipe)[0])
    assert bubble_fraction(one_f_one_b)[0] == pytest.approx((pp - 1) / (m + pp - 1))
    peaks = _peak_in_flight(one_f_one_b)
    assert max(peaks) <= pp
    assert peaks == [pp - r for r in range(pp)]       # rank r holds pp - r micro-batches
    assert _peak_in_flight(gpipe) == [m] * pp          # GPipe holds all of them


@pytest.mark.fast
def test_interleaved_bubble_shrinks_with_more_microbatches():
    few, many = (bubble_fraction(schedule_timeline("interleaved_1f1b", 4, m))[0]
                 for m in (4, 16))
    assert many < few
    # interleaving itself beats 1F1B at the same micro-batch count
    assert (bubble_fraction(schedule_timeline("interleaved_1f1b", 4, 8))[0]
            < bubble_fraction(schedule_timeline("1f1b", 4, 8))[0])


def _check_timeline(tl):
    """Each (stage, mb) once forward and once backward (B, or I + W); ranks never overlap;
    every action starts after what it depends on."""
    seen = Counter((b.kind, b.stage, b.microbatch) for rank in tl.ranks for b in rank)
    assert max(seen.values()) == 1
    ends = {(b.kind, b.stage, b.microbatch): b.start + b.duration
            for rank in tl.ranks for b in rank}
    for s in range(tl.num_stages):
        for mb in range(tl.n_microbatches):
            assert seen[("F", s, mb)] == 1
            assert seen[("B", s, mb)] + seen[("I", s, mb)] == 1
            assert seen[("I", s, mb)] == seen[("W", s, mb)]
    assert sum(seen.values()) == sum(len(rank) for rank in tl.ranks)
    for rank in tl.ranks:
        for prev, nxt in zip(rank, rank[1:]):
            assert prev.start + prev.duration <= nxt.start
        for b in rank:
            if b.kind == "F" and b.stage > 0:
                assert b.start >= ends[("F", b.stage - 1, b.microbatch)]
            if b.kind in ("B", "I"):
                assert b.start >= ends[("F", b.stage, b.microbatch)]
                if b.stage < tl.num_stages - 1:
                    grad = ends.get(("B", b.stage + 1, b.microbatch),
                                    ends.get(("I", b.stage + 1, b.microbatch)))
                    assert b.start >= grad
            if b.kind == "W":
                assert b.start >= ends[("I", b.stage, b.microbatch)]


@pytest.mark.fast
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_draws_a_png_and_runs_each_action_once(name, tmp_path):
    _check_timeline(schedule_timeline(name, 4, 8))
    tl = schedule_timeline(name, 2, 4)
    _check_timeline(tl)
    out = draw(tl, str(tmp_path / f"{name}.png"))
    with open(out, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    overall, per_rank = bubble_fraction(tl)
    assert 0 <= overall < 1 and len(per_rank) == 2


@pytest.mark.fast
def test_invalid_inputs_are_reported_clearly(capsys):
    with pytest.raises(ValueError, match="valid names: 1f1b, gpipe"):
        schedule_timeline("nope", 4, 8)
    with pytest.raises(ValueError, match=r"exactly 2 stages per rank"):
        schedule_timeline("v_schedule", 4, 8, stages_per_rank=3)
    with pytest.raises(ValueError, match=r"greater than\s+or equal to the number of stages"):
        schedule_timeline("1f1b", 4, 2)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        schedule_timeline("interleaved_1f1b", 4, 9)
    with pytest.raises(SystemExit) as exit_info:
        picture.main(["--schedule", "nope"])
    assert exit_info.value.code == 2
    assert "valid names" in capsys.readouterr().err


def test_cli_prints_the_bubble_fraction(tmp_path):
    out = tmp_path / "schedule.png"
    result = subprocess.run(
        [sys.executable, "-m", "automodel.distributed.pipelining.picture", "--schedule",
         "1f1b", "--pp-size", "4", "--microbatches", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=True)
    assert "1f1b, pp=4, 8 micro-batches: bubble fraction 27.3% (per rank: 27.3%" in result.stdout
    assert out.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.fast
def test_no_process_group_is_started(tmp_path):
    for name in SCHEDULES:
        tl = schedule_timeline(name, 4, 8)
    draw(tl, str(tmp_path / "last.png"))
    assert not dist.is_initialized()
