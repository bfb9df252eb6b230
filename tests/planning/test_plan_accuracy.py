"""The plan against the run (issue 27, "Proof"): for each layout of
``benchmarks/plan_accuracy.py`` (DDP, FSDP2, HSDP, TP2+SP, CP2, PP 1F1B and interleaved, EP2,
full and selective activation checkpointing, CPU offload, an image-text model with a frozen
vision tower and under TP2+SP, CP2 and 1F1B, LoRA adapters under FSDP2, TP2+SP and 1F1B),
one real job on gloo ranks and the plan of the same overrides, made in this process as
``plan.py`` makes it. One run serves three checks:

- memory: each rank class's planned peak is within 10% of ``peak_tensor_bytes_by_rank`` of
  every rank of the class at steps 2 and 3 (its example rank included);
- communication: the planned bytes per mesh axis and collective kind are those counted in the
  example rank's profiler trace of step 3, exactly. Expert parallelism's all-to-all carries
  what the router chose, which the plan cannot know and simulates balanced: per rank it
  differs by the imbalance, but over the ranks its sum is routing-free (each rank sends its
  tokens x top_k out, and back what it received), and equals the plan's times the ranks;
- bubble: the plan's equals ``bubble_of_run`` of the schedule object the run built and ran
  (every rank's), and each rank ran exactly that object's compute order.

The measured table is in docs/planning.md ("Accuracy")."""

from __future__ import annotations

import pytest

from benchmarks.plan_accuracy import LAYOUTS, bubble_ran, measure_layout

TOLERANCE = 0.10


def _check_memory(res: dict) -> None:
    for r in res["ranks"]:
        for rank, peaks in r["measured_by_rank"].items():
            assert len(peaks) == 2, (r["name"], rank, peaks)  # steps 2 and 3
            for measured in peaks:
                assert abs(r["predicted"] - measured) <= TOLERANCE * measured, (
                    f"{res['layout']} {r['name']} rank {rank}: planned {r['predicted']:,}, "
                    f"measured {measured:,}; plan {r['memory']}, tracker {r['detail']}")


def _check_comm(res: dict) -> None:
    every = res["comm_all_ranks"]
    for r in res["ranks"]:
        planned, measured = r["comm_planned"], r["comm_measured"]
        assert planned and measured == every[r["example_rank"]], res["layout"]
        assert r["comm_exact"], (res["layout"], r["name"], planned, measured)
        if "ep" not in planned:
            assert measured == planned, (res["layout"], r["name"])
            continue
        # routed: per rank as the router chose; summed over the ranks, the plan's times them
        routed = [every[m]["ep"]["all_to_all"] for m in r["ranks"]]
        assert sum(routed) == len(routed) * planned["ep"]["all_to_all"], routed
        assert planned["ep"]["all_to_all"] > 0


def _check_bubble(res: dict, pp: int) -> None:
    ran = bubble_ran(res)
    if pp == 1:
        assert res["bubble_planned"] == 0.0 and ran is None
        return
    assert sorted(res["schedules"]) == list(range(pp))  # (every rank recorded its own)
    assert ran == res["bubble_planned"] > 0
    for rank, s in res["schedules"].items():
        assert [tuple(a) for a in s["ran"]] == [tuple(a) for a in s["order"]], rank


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_matches_the_run(name, tmp_path):
    res = measure_layout(name, str(tmp_path))
    _check_memory(res)
    _check_comm(res)
    _check_bubble(res, res["layout_sizes"]["pp"])
