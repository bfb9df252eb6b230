"""``trainer.plan_check_steps=N``: the run measures what its plan (``plan.json``, made before
any rank started) predicted, and after N steps says how far apart they are.

Of the run's first N steps: the first warms up (allocations, lazy initialisation) and is not
measured; the second's collectives are counted per mesh axis (a dispatch mode, the
planner's own counter, which slows that step: it is not timed either); the others are timed
(their median is the step time). Each rank's peak of live tensor bytes comes from the step's
read (``peak_tensor_bytes``: the CUDA allocator's on a GPU; on the CPU only with
``trainer.track_tensor_memory=true``), of the timed steps (a step's read covers the previous
step's optimizer step: step 2's would hold step 1's, which makes the optimizer's states).
After step N the ranks' counts meet on rank 0 (one gather, once), which writes
``plan_check.json`` (the plan's check entry, what was measured, the two side by side, and
the calibration that makes the plan's step time the run's, for ``plan.calibrate_from``) and
logs the comparison.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics

import torch.distributed as dist

from automodel.costing import calibrate

log = logging.getLogger("automodel")


class PlanCheck:
    def __init__(self, cfg, setup, output_dir: str, start_step: int, group):
        n = cfg.trainer.plan_check_steps
        self.output_dir, self.group, self.mesh = output_dir, group, setup.mesh
        self.counted = start_step + 2  # (the first step warms up)
        self.last = start_step + n
        self.count_comm = not getattr(cfg.parallelism, "enable_compile", False)
        self.seconds: list[float] = []
        self.peaks: list | None = None
        self.comm = None
        self.check = None
        if setup.dist.is_main:
            path = os.path.join(output_dir, "plan.json")
            if os.path.isfile(path):
                with open(path) as f:
                    self.check = json.load(f).get("check")
            if self.check is None:  # (the launch refuses this; a run started otherwise)
                log.warning("trainer.plan_check_steps=%d: %s holds no plan to compare with "
                            "(the launch plans the job before the ranks start): no plan check",
                            n, path)

    def window(self, number: int):
        """Around step ``number``'s work: the collectives of the counted step are counted."""
        if number != self.counted or not self.count_comm or self.mesh is None:
            return contextlib.nullcontext()
        from automodel.costing.comm import CommCounter, axis_groups
        from automodel.costing.counters import StepCounters

        self.comm = CommCounter(axis_groups(self.mesh))
        return StepCounters(self.comm)

    def after(self, number: int, seconds: float, values) -> None:
        """Step ``number`` ran in ``seconds``; ``values``: its ``StepValues``."""
        if number > self.last or number <= self.counted:
            return
        self.seconds.append(seconds)
        by_rank = values.peak_tensor_bytes_by_rank  # (from step 3: step 2's window holds
        if by_rank is not None:  # step 1's optimizer step, which makes the states)
            self.peaks = by_rank if self.peaks is None else [
                max(a, b) for a, b in zip(self.peaks, by_rank)]
        if number == self.last:
            self._report(number)

    def _training_comm(self) -> dict:
        """The counted step's bytes without the step's read (``read_step``'s gather of
        three int64 values per rank on the model's group: bookkeeping, not training)."""
        out = self.comm.result()
        if self.group is not None:
            size = dist.get_world_size(self.group)
            axis = self.comm.axis_of.get(self.group) or "ranks " + ",".join(
                map(str, dist.get_process_group_ranks(self.group)))
            kinds = out.get(axis, {})
            if kinds.get("all_gather", 0) >= 24 * size:
                kinds["all_gather"] -= 24 * size
                out[axis] = {k: v for k, v in kinds.items() if v}
        return {a: k for a, k in out.items() if k}

    def _report(self, number: int) -> None:
        mine = None if self.comm is None else self._training_comm()
        everyone = [mine]
        if self.group is not None and dist.get_world_size(self.group) > 1:
            everyone = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, mine, group=self.group)
        if self.check is None:
            return
        measured = {
            "steps_timed": [self.counted + 1, number], "step_seconds": self.seconds,
            "step_time_s": statistics.median(self.seconds),
            "step_time_spread_s": (max(self.seconds) - min(self.seconds)) / 2,
            "comm_step": self.counted,
            "ranks": {r: {"peak_bytes": None if self.peaks is None else self.peaks[r],
                          "comm": everyone[r]} for r in range(len(everyone))}}
        result = calibrate.compare(self.check, measured)
        fitted, note = calibrate.fit_calibration(self.check, measured["step_time_s"])
        record = {"check": self.check, "measured": measured, "comparison": result,
                  "calibration": fitted, "calibration_note": note}
        path = os.path.join(self.output_dir, calibrate.CHECK_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)
        steps = f"steps {self.counted + 1}-{number} timed, step {self.counted}'s bytes counted"
        for line in calibrate.comparison_lines(result, steps):
            log.info(line)
        log.info("plan check: the plan's step time matches this run at %s (%s; plan.py "
                 "plan.calibrate_from=%s)", ", ".join(
                     f"{k}={v:.3g}" for k, v in fitted.items() if k in
                     ("compute_efficiency", "comm_efficiency")), path,
                 os.path.abspath(self.output_dir))


def plan_check_for(cfg, setup, output_dir: str, start_step: int, group) -> PlanCheck | None:
    """The run's ``PlanCheck`` (None: ``trainer.plan_check_steps`` off, or the run's steps
    end before it)."""
    n = cfg.trainer.plan_check_steps
    last = cfg.trainer.stop_at_step or cfg.trainer.max_steps
    if not n or start_step + n > last:
        if n:
            log.warning("trainer.plan_check_steps=%d: this run ends at step %d, before the "
                        "check (it starts after step %d): no plan check", n, last, start_step)
        return None
    return PlanCheck(cfg, setup, output_dir, start_step, group)
