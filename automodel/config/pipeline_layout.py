"""Pipeline layout arithmetic: schedule shapes, stage counts, layer ranges. No torch, so
config validation can use it before any process starts."""

from __future__ import annotations

# name -> (multi_stage, v_placement); schedule.py maps the same names to torch classes.
SCHEDULE_SHAPES = {
    "1f1b": (False, False),
    "gpipe": (False, False),
    "interleaved_1f1b": (True, False),
    "looped_bfs": (True, False),
    "dfs": (True, False),
    "zero_bubble": (True, False),
    "v_schedule": (True, True),
    "dualpipev": (True, True),
}
# torch's class names (lower-cased) that differ from ours
TORCH_NAMES = {"interleaved1f1b": "interleaved_1f1b", "loopedbfs": "looped_bfs",
               "interleavedzerobubble": "zero_bubble", "zbvzerobubble": "v_schedule",
               "schedulegpipe": "gpipe", "schedule1f1b": "1f1b"}


def canonical_schedule(name: str) -> str:
    """Our name for a schedule given by our name or torch's (any case); ValueError if none."""
    key = name.lower()
    key = TORCH_NAMES.get(key, key)
    if key not in SCHEDULE_SHAPES:
        raise ValueError(f"pipeline.pp_schedule={name!r} is not a schedule; allowed: "
                         f"{', '.join(SCHEDULE_SHAPES)} (or torch's class names such as "
                         "Interleaved1F1B, ZBVZeroBubble, DualPipeV)")
    return key


def stage_layer_ranges(num_layers: int, num_stages: int,
                       layers_per_stage: int | None = None) -> list[range]:
    """Even split, remainder to the first stages; or a fixed number per stage."""
    if layers_per_stage is not None:
        if layers_per_stage * num_stages != num_layers:
            raise ValueError(f"pipeline.layers_per_stage={layers_per_stage} x {num_stages} "
                             f"stages != the model's {num_layers} layers")
        sizes = [layers_per_stage] * num_stages
    else:
        if num_stages > num_layers:
            raise ValueError(f"{num_stages} pipeline stages need at least as many layers; the "
                             f"model has {num_layers}")
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def count_stages(num_layers: int, pp_size: int, multi_stage: bool, v_placement: bool,
                 layers_per_stage: int | None, rounding: str | None) -> int:
    """How many stages in total: one per rank, two per rank for V schedules, otherwise
    ``num_layers / layers_per_stage`` (optionally rounded to a multiple of pp) or 2 per rank."""
    if not multi_stage:
        return pp_size
    if v_placement:
        return 2 * pp_size
    if layers_per_stage is None:
        return 2 * pp_size
    stages = max(1, num_layers // layers_per_stage)
    if stages % pp_size:
        if rounding == "up":
            stages = -(-stages // pp_size) * pp_size
        elif rounding == "down":
            stages = max(pp_size, stages // pp_size * pp_size)
        else:
            raise ValueError(f"{stages} virtual stages (from pipeline.layers_per_stage="
                             f"{layers_per_stage}) is not a multiple of mesh.pp_size={pp_size}; "
                             "set pipeline.round_virtual_stages_to_pp_multiple=up or down")
    return stages
