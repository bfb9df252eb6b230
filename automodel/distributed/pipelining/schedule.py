"""Schedule names -> torch.distributed.pipelining schedules, and stage placement.

| name (pipeline.pp_schedule) | torch schedule                   | stages per rank | placement |
|-----------------------------|----------------------------------|-----------------|-----------|
| 1f1b                        | Schedule1F1B                     | 1               | -         |
| gpipe                       | ScheduleGPipe                    | 1               | -         |
| interleaved_1f1b            | ScheduleInterleaved1F1B          | >= 2            | loop      |
| looped_bfs                  | ScheduleLoopedBFS (breadth-first)| >= 2            | loop      |
| dfs                         | ScheduleInterleaved1F1B          | >= 2            | loop      |
|                             | (an alias of interleaved_1f1b)   |                 |           |
| zero_bubble                 | ScheduleInterleavedZeroBubble    | >= 2            | loop      |
| v_schedule                  | ScheduleZBVZeroBubble            | 2               | V         |
| dualpipev                   | ScheduleDualPipeV                | 2               | V         |

torch's own class names (e.g. ``Interleaved1F1B``, ``ZBVZeroBubble``) are accepted
case-insensitively.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining import schedules as S

from automodel.config.pipeline_layout import SCHEDULE_SHAPES, canonical_schedule


@dataclass(frozen=True)
class ScheduleSpec:
    cls: type
    multi_stage: bool
    v_placement: bool = False


SCHEDULES = {  # shapes must agree with layout.SCHEDULE_SHAPES
    "1f1b": ScheduleSpec(S.Schedule1F1B, False),
    "gpipe": ScheduleSpec(S.ScheduleGPipe, False),
    "interleaved_1f1b": ScheduleSpec(S.ScheduleInterleaved1F1B, True),
    "looped_bfs": ScheduleSpec(S.ScheduleLoopedBFS, True),
    "dfs": ScheduleSpec(S.ScheduleInterleaved1F1B, True),
    "zero_bubble": ScheduleSpec(S.ScheduleInterleavedZeroBubble, True),
    "v_schedule": ScheduleSpec(S.ScheduleZBVZeroBubble, True, v_placement=True),
    "dualpipev": ScheduleSpec(S.ScheduleDualPipeV, True, v_placement=True),
}


def schedule_spec(name: str) -> ScheduleSpec:
    return SCHEDULES[canonical_schedule(name)]


def stages_of_rank(pp_rank: int, pp_size: int, num_stages: int, v_placement: bool) -> list[int]:
    """Stage indices owned by ``pp_rank``: loop placement (r, r+pp, ...) or V (r, 2pp-1-r)."""
    if v_placement:
        assert num_stages == 2 * pp_size, "V schedules place exactly two stages per rank"
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp_size))


assert {k: (v.multi_stage, v.v_placement) for k, v in SCHEDULES.items()} == SCHEDULE_SHAPES
