"""What the collective timeout (``distributed.timeout_minutes``) measures, on real gloo ranks
with timeouts of a second instead of minutes.

Found (torch 2.13, gloo): the timeout bounds how long one rank waits *inside* a collective
for the others. Time a rank spends busy before calling a collective does not count when every
rank is busy alike; it counts when one rank is late while another already waits: then the
waiting rank fails after exactly the timeout, the late rank fails at once when it arrives
("Connection closed by peer"), and the group is dead for both. ``monitored_barrier``'s own
timeout is only rank 0's wait: the other ranks wait in it under the group's timeout, so it does
not shield a slow rank 0. A group's timeout can be lowered after start-up
(``_set_pg_timeout``, what torchtitan does after the first step): start long, then shorten.
"""

import datetime
import time

from tests.helpers import run_on_ranks

SECOND = datetime.timedelta(seconds=1)
LONG = datetime.timedelta(seconds=10)
LATE = 1.8  # seconds rank 0 arrives after rank 1: longer than SECOND, well under LONG


def _timed(fn) -> tuple:
    """("ok" | the error's first line, seconds it took)."""
    started = time.monotonic()
    try:
        fn()
        outcome = "ok"
    except Exception as err:  # the collective's error is what we record
        outcome = str(err).splitlines()[0]
    return outcome, time.monotonic() - started


def _all_reduce(group=None):
    import torch
    import torch.distributed as dist

    return lambda: dist.all_reduce(torch.ones(1), group=group)


def _busy_then_late(rank, world):
    """A group with a 1 s timeout: busy ranks, a slightly late rank, a rank late by more."""
    out = {}
    time.sleep(1.5)  # every rank busy longer than the timeout (compile, loading), alike
    out["all_busy"] = _timed(_all_reduce())
    if rank == 0:
        time.sleep(0.2)  # rank 0 late by less than the timeout
    out["late_within"] = _timed(_all_reduce())
    if rank == 0:
        time.sleep(LATE)  # e.g. rank 0 alone exporting a checkpoint or starting W&B
    out["late_beyond"] = _timed(_all_reduce())
    out["after"] = _timed(_all_reduce())
    return out


def _long_then_lowered(rank, world):
    """The runner's scheme (automodel.distributed.init.set_collective_timeout): groups start
    with the long start-up timeout, it is lowered after the first step and raised again
    around rank 0's solo phases."""
    import torch.distributed as dist

    from automodel.distributed.init import set_collective_timeout

    sub = dist.new_group([0, 1], timeout=LONG)  # as a mesh axis gets its own group
    out = {}
    if rank == 0:
        time.sleep(LATE)  # start-up: rank 0 loads alone
    out["late_under_long"] = _timed(_all_reduce(sub))
    set_collective_timeout(LONG)  # a save: rank 0 exports alone
    if rank == 0:
        time.sleep(LATE)  # rank 0 late by LATE: longer than SECOND, under LONG
    out["late_in_solo_phase"] = _timed(_all_reduce(sub))
    set_collective_timeout(SECOND)  # training
    if rank == 0:
        time.sleep(LATE)  # rank 0 late by LATE: longer than SECOND, under LONG
    out["late_under_lowered"] = _timed(_all_reduce(sub))
    return out


def _monitored_barrier_with_slow_rank0(rank, world):
    import torch.distributed as dist

    if rank == 0:
        time.sleep(LATE)  # rank 0 late by LATE: longer than SECOND, under LONG
    return {"monitored_barrier": _timed(lambda: dist.monitored_barrier(timeout=LONG))}


def test_timeout_is_the_wait_inside_a_collective(tmp_path):
    rank0, rank1 = run_on_ranks(_busy_then_late, 2, tmp_path=tmp_path, timeout=SECOND)
    for r in (rank0, rank1):
        assert r["all_busy"][0] == "ok" and r["late_within"][0] == "ok"
    # the waiting rank gives up after the timeout, before the late one arrives...
    outcome, waited = rank1["late_beyond"]
    assert "Timed out waiting 1000ms" in outcome and 0.9 < waited < LATE
    # ...which then fails on arrival: the connection is gone, and so is the group
    outcome, waited = rank0["late_beyond"]
    assert outcome != "ok" and waited < 0.5, rank0
    assert rank0["after"][0] != "ok" and rank1["after"][0] != "ok"


def test_a_long_start_up_timeout_can_be_lowered_afterwards(tmp_path):
    rank0, rank1 = run_on_ranks(_long_then_lowered, 2, tmp_path=tmp_path, timeout=LONG)
    assert rank0["late_under_long"][0] == rank1["late_under_long"][0] == "ok"
    assert rank1["late_under_long"][1] > LATE - 0.3  # it did wait for rank 0
    assert rank0["late_in_solo_phase"][0] == rank1["late_in_solo_phase"][0] == "ok"
    outcome, waited = rank1["late_under_lowered"]
    assert "Timed out waiting 1000ms" in outcome and waited < LATE


def test_monitored_barrier_timeout_does_not_cover_the_other_ranks(tmp_path):
    rank0, rank1 = run_on_ranks(_monitored_barrier_with_slow_rank0, 2, tmp_path=tmp_path,
                                timeout=SECOND)
    outcome, waited = rank1["monitored_barrier"]
    # rank 1 waited under the group's 1 s, not the barrier's 10 s
    assert outcome != "ok" and waited < LATE, rank1
    assert rank0["monitored_barrier"][0] != "ok"
