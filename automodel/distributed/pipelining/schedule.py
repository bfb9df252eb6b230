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

from automodel.config.pipeline_csv import read_csv_layout
from automodel.config.pipeline_layout import SCHEDULE_SHAPES, canonical_schedule, count_stages


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


def stage_layout(pipeline, pp_size: int, num_layers: int | None = None
                 ) -> tuple[int, list[list[int]]]:
    """(total stage count, each pp rank's stage indices) for the pipeline config: the CSV's
    rows, else one stage per entry of ``module_fqns_per_model_part``, else ``count_stages``
    (``num_layers`` is read only with ``layers_per_stage``). The run (``stages.split_model``)
    and the planner (``distributed/pipelining/bubble.py``) both place stages with it."""
    if pipeline.pp_schedule_csv is not None:  # the CSV says which stages each rank runs
        layout = read_csv_layout(pipeline.pp_schedule_csv)
        return layout.num_stages, layout.stages_by_rank
    spec = schedule_spec(pipeline.pp_schedule)
    if pipeline.module_fqns_per_model_part is not None:
        num_stages = len(pipeline.module_fqns_per_model_part)
    else:
        if pipeline.layers_per_stage is not None and num_layers is None:
            raise ValueError("pipeline.layers_per_stage sets the stage count from the model's "
                             "layers: pass num_layers")
        num_stages = count_stages(num_layers, pp_size, spec.multi_stage, spec.v_placement,
                                  pipeline.layers_per_stage,
                                  pipeline.round_virtual_stages_to_pp_multiple)
    return num_stages, stages_by_rank(pipeline, pp_size, num_stages)


def stages_by_rank(pipeline, pp_size: int, num_stages: int) -> list[list[int]]:
    """Each pp rank's stage indices, for ``num_stages`` stages (``stage_layout``'s second
    half: every rank can tell where any stage lives without asking the others)."""
    if pipeline.pp_schedule_csv is not None:
        return read_csv_layout(pipeline.pp_schedule_csv).stages_by_rank
    spec = schedule_spec(pipeline.pp_schedule)
    return [stages_of_rank(r, pp_size, num_stages, spec.v_placement) for r in range(pp_size)]


def make_schedule(stages: list, pipeline, n_microbatches: int, **kwargs):
    """The torch schedule automodel runs for the pipeline config, over this rank's stages
    (``PipelineStage`` objects, in ``stage_layout`` order); ``kwargs`` (``loss_fn``, ...) go
    to its constructor. One home for config -> schedule class and arguments: the run
    (``stages.build_schedule``) and the planner (``bubble.py``) both build with it."""
    kwargs = dict(n_microbatches=n_microbatches, scale_grads=pipeline.scale_grads_in_schedule,
                  **kwargs)
    if pipeline.pp_schedule_csv is not None:
        from automodel.compat import csv_schedule

        return csv_schedule(stages, pipeline.pp_schedule_csv,
                            read_csv_layout(pipeline.pp_schedule_csv).format, **kwargs)
    spec = schedule_spec(pipeline.pp_schedule)
    if spec.multi_stage:
        return spec.cls(stages, **kwargs)
    [stage] = stages
    return spec.cls(stage, **kwargs)


assert {k: (v.multi_stage, v.v_placement) for k, v in SCHEDULES.items()} == SCHEDULE_SHAPES
