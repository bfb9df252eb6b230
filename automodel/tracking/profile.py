"""Where a step's time goes (``trainer.profile_steps=[first, last]``).

The steps ``first..last`` run under ``torch.profiler``. Each rank writes its trace
(``profile/trace_rank<r>.json``, for chrome://tracing or Perfetto) and a breakdown
(``profile/breakdown_rank<r>.json``); rank 0 logs its own as a table. The phases are the
labels the step puts on its parts (``automodel::forward``, ``loss``, ``backward``, ``clip``,
``optimizer``); *collectives* is the time the main thread spends launching and waiting for
communication inside them; *host work* is the rest of the step (data, bookkeeping, logging).
The trace records operators' shapes, so each collective's tensor sizes are in it; and each
rank writes ``profile/collectives_rank<r>.json``: the collectives of those steps as c10d's
flight recorder saw them, with their process groups (``planning/measured.py`` reads both).
Costs nothing outside those steps (the flight recorder: a ring buffer of records).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import defaultdict

import torch

from automodel.compat import flight_recorder_entries

log = logging.getLogger(__name__)
PHASES = ("forward", "loss", "backward", "clip", "optimizer")
_COMM = re.compile(r"all_gather|allgather|reduce_scatter|allreduce|all_reduce|broadcast|"
                   r"all_to_all|alltoall|\bwait\b|c10d::|gloo|nccl", re.IGNORECASE)


def breakdown(events, steps: int) -> dict:
    """Seconds per step of each phase, of the collectives inside them, and of host work, from
    the profiler's events of ``steps`` whole steps (``automodel::step`` ranges)."""
    phase = defaultdict(float)
    comm = 0.0
    step_total = 0.0
    ranges = {name: [] for name in PHASES}
    for e in events:
        if e.name == "automodel::step":
            step_total += e.cpu_time_total
        elif e.name.startswith("automodel::") and e.name[11:] in PHASES:
            phase[e.name[11:]] += e.cpu_time_total
            ranges[e.name[11:]].append((e.time_range.start, e.time_range.end))
    spans = sorted(r for rs in ranges.values() for r in rs)
    for e in events:  # outermost communication events inside a phase (main thread)
        if not _COMM.search(e.name) or e.cpu_parent is not None and _COMM.search(
                e.cpu_parent.name):
            continue
        start = e.time_range.start
        if any(a <= start < b for a, b in spans):
            comm += e.cpu_time_total
    us = 1e6 * steps
    out = {name: phase[name] / us for name in PHASES}
    out["collectives (inside the phases)"] = comm / us
    out["host work"] = max(step_total - sum(phase.values()), 0.0) / us
    out["step"] = step_total / us
    return out


def write_collectives(path: str, start_ns: int, end_ns: int) -> None:
    """The flight recorder's collectives created between ``start_ns`` and ``end_ns`` (wall
    clock, as the trace's), with ``complete``: whether the recorder still held the first of
    them (false: its buffer, ``TORCH_FR_BUFFER_SIZE``, was too small or it was off)."""
    entries = flight_recorder_entries()
    kept = [{"pg_name": e["process_group"][0], "pg_desc": e["process_group"][1],
             "name": e["profiling_name"], "time_created_ns": e["time_created_ns"],
             "input_sizes": e["input_sizes"], "input_dtypes": e["input_dtypes"],
             "output_sizes": e["output_sizes"], "output_dtypes": e["output_dtypes"],
             "is_p2p": e.get("is_p2p", False)}
            for e in entries if start_ns <= e["time_created_ns"] <= end_ns]
    complete = bool(entries) and entries[0]["time_created_ns"] < start_ns
    with open(path, "w") as f:
        json.dump({"start_ns": start_ns, "end_ns": end_ns, "complete": complete,
                   "collectives": kept}, f)


class StepProfiler:
    def __init__(self, steps, output_dir: str, rank: int, is_main: bool,
                 device_type: str = "cpu"):
        self.first, self.last = (steps or (None, None))
        self.device_type = device_type  # the rank's device: CUDA activity is traced on CUDA only
        self.dir = os.path.join(output_dir, "profile")
        self.rank, self.is_main = rank, is_main
        self.prof = None
        self.step_range = None

    def begin(self, number: int) -> None:
        if self.first is None:
            return
        if number == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device_type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
            self.started_ns = time.time_ns()
        if self.prof is not None:
            self.step_range = torch.profiler.record_function("automodel::step")
            self.step_range.__enter__()

    def end(self, number: int) -> None:
        if self.prof is None:
            return
        self.step_range.__exit__(None, None, None)
        if number < self.last:
            return
        self.prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        self.prof.export_chrome_trace(os.path.join(self.dir, f"trace_rank{self.rank}.json"))
        write_collectives(os.path.join(self.dir, f"collectives_rank{self.rank}.json"),
                          self.started_ns, time.time_ns())
        table = breakdown(self.prof.events(), self.last - self.first + 1)
        with open(os.path.join(self.dir, f"breakdown_rank{self.rank}.json"), "w") as f:
            json.dump({"steps": [self.first, self.last], "seconds_per_step": table}, f, indent=1)
        if self.is_main:
            log.info("profile of steps %d-%d (rank 0, seconds per step): %s; traces in %s",
                     self.first, self.last,
                     ", ".join(f"{k} {v:.4f}" for k, v in table.items()), self.dir)
        self.prof = None
