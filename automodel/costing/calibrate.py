"""The plan beside the run. Torch-free.

A planned job (``layout=auto``, or ``trainer.plan_check_steps`` on a manual layout) starts
with ``plan.json`` beside it, whose ``check`` entry (``check_entry``) is what the run compares
itself with: per rank class, the predicted peak of live tensor bytes, FLOPs and collective
bytes per mesh axis; the job's step time, and what costed it (the device profile, the
calibration, the bubble, the mesh's sizes). After ``trainer.plan_check_steps`` steps the run
measures the same (``tracking/plan_check.py``) and ``compare`` sets them side by side;
``fit_calibration`` finds the efficiencies at which the plan's step time is the run's, and
``plan.calibrate_from=RUN_DIR`` (``read_calibration``) plans with them.
"""

from __future__ import annotations

import json
import os

from automodel.config.build import ConfigError
from automodel.costing import cost
from automodel.costing.gpus import GpuProfile

CHECK_FILE = "plan_check.json"  # the run's record, beside plan.json
_RANK_KEYS = ("name", "example_rank", "count", "stages", "peak_bytes", "flops",
              "comm_bytes_per_step")


def check_entry(plan: dict) -> dict:
    """What a run compares itself with, from a plan (``make_plan``'s dict)."""
    return {"gpu": plan["gpu"], "calibration": plan["calibration"], "bubble": plan["bubble"],
            "sizes": cost.mesh_sizes(plan["layout"]), "step_time_s": plan["step_time_s"],
            "ranks": [{k: r[k] for k in _RANK_KEYS} for r in plan["ranks"]]}


def predicted_step(check: dict, calibration: dict | None = None) -> float:
    """The job's predicted step time (its slowest rank class) under ``calibration`` (None:
    the plan's own)."""
    profile = GpuProfile(**check["gpu"])
    calibration = check["calibration"] if calibration is None else calibration
    return max(cost.step_time(r["flops"], r["comm_bytes_per_step"], check["sizes"], profile,
                              check["bubble"], calibration).step_time_s
               for r in check["ranks"])


def fit_calibration(check: dict, measured_s: float) -> tuple[dict, str]:
    """(the calibration at which the plan's step time equals ``measured_s``, a note saying
    what was fitted): the compute efficiency (bisected: the step falls as it rises); where
    the communication alone is slower than the run, the compute efficiency is 1 and the
    communication's is fitted; an unreachable time keeps the nearest."""
    base = dict(check["calibration"])
    efficiency, step = bisect_efficiency(check, measured_s, "compute_efficiency", base)
    if efficiency < 1.0 or step <= measured_s * (1 + 1e-6):
        return {**base, "compute_efficiency": efficiency}, \
            "compute_efficiency fitted to the measured step"
    fixed = {**base, "compute_efficiency": 1.0}
    comm, step = bisect_efficiency(check, measured_s, "comm_efficiency", fixed)
    note = ("the communication alone was slower than the run at the plan's efficiency: "
            "compute_efficiency 1, comm_efficiency fitted")
    if step > measured_s * 1.01:
        note += f" (still {step / measured_s:.2f}x the run: its bubble or bandwidths are off)"
    return {**fixed, "comm_efficiency": comm}, note


def bisect_efficiency(check: dict, measured_s: float, key: str,
                      fixed: dict) -> tuple[float, float]:
    """(the efficiency ``key`` in (0, 1] at which the plan's step is ``measured_s``, the plan's
    step at it), the rest of the calibration ``fixed``: bisected in log space (the step falls
    as the efficiency rises); 1 where even that is slower than ``measured_s``."""
    lo, hi = 1e-12, 1.0
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predicted_step(check, {**fixed, key: mid}) > measured_s \
            else (lo, mid)
    return hi, predicted_step(check, {**fixed, key: hi})


def class_of(check: dict, rank: int) -> dict | None:
    """The planned rank class ``rank`` belongs to (None: a class the plan left out)."""
    for r in check["ranks"]:
        if r["example_rank"] <= rank < r["example_rank"] + r["count"]:
            return r
    return None


def compare(check: dict, measured: dict) -> dict:
    """The plan and the run side by side: step time; per rank class its peak (the largest of
    its ranks) and its example rank's bytes per axis. ``measured``: ``step_time_s`` and
    ``ranks`` (rank -> ``peak_bytes`` and ``comm``, each None when not measured)."""
    out = {"step_time": _pair(check["step_time_s"], measured["step_time_s"]), "ranks": []}
    for r in check["ranks"]:
        mine = [m for rank, m in measured["ranks"].items() if class_of(check, int(rank)) is r]
        peaks = [m["peak_bytes"] for m in mine if m.get("peak_bytes")]
        example = measured["ranks"].get(r["example_rank"]) or measured["ranks"].get(
            str(r["example_rank"])) or {}
        comm = example.get("comm")
        axes = sorted(set(r["comm_bytes_per_step"]) | set(comm or {}))
        out["ranks"].append({
            "name": r["name"], "peak_bytes": _pair(r["peak_bytes"], max(peaks, default=None)),
            "comm_bytes": None if comm is None else {
                a: _pair(sum(r["comm_bytes_per_step"].get(a, {}).values()),
                         sum(comm.get(a, {}).values())) for a in axes}})
    return out


def _pair(predicted, measured) -> dict:
    ratio = predicted / measured if measured else None
    return {"predicted": predicted, "measured": measured, "plan_over_run": ratio}


def comparison_lines(result: dict, steps: str) -> list[str]:
    """The comparison in a few lines for train.log."""
    t = result["step_time"]
    lines = [f"plan check ({steps}): step time {t['measured']:.4g} s measured, "
             f"{t['predicted']:.4g} s planned (plan/run {t['plan_over_run']:.3f})"]
    for r in result["ranks"]:
        p = r["peak_bytes"]
        memory = (f"peak {p['measured'] / 2**20:.1f} MiB measured, {p['predicted'] / 2**20:.1f} "
                  f"MiB planned (plan/run {p['plan_over_run']:.3f})" if p["measured"] else
                  "peak not measured (on the CPU: trainer.track_tensor_memory=true)")
        comm = r["comm_bytes"]
        traffic = "bytes per axis not counted" if comm is None else "bytes per step " + (
            ", ".join(f"{a} {c['measured'] / 2**20:.2f}/{c['predicted'] / 2**20:.2f} MiB"
                      for a, c in comm.items()) or "none") + " (run/plan)"
        lines.append(f"  {r['name']}: {memory}; {traffic}")
    return lines


def read_calibration(run_dir: str) -> tuple[dict, dict]:
    """(the device profile the run was planned on, its fitted calibration) from a planned
    run's ``plan_check.json`` (``plan.calibrate_from=RUN_DIR``)."""
    path = os.path.join(run_dir, CHECK_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"plan.calibrate_from={run_dir!r}: no {CHECK_FILE} there. A planned "
                          "run writes it after trainer.plan_check_steps steps (layout=auto, or "
                          "trainer.plan_check_steps=N on a local or hydra/launcher=slurm launch)")
    with open(path) as f:
        record = json.load(f)
    return record["check"]["gpu"], record["calibration"]
