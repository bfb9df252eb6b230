"""Pipeline schedules written as CSV, in torch's two formats. Reading them needs no torch.

One row per pipeline rank, one action per cell, as ``<stage><type><micro-batch>``:
``0F3`` (forward), ``1B0`` (full backward), ``1I0`` / ``1W0`` (input / weight gradient).
The compute+comms format adds communication and FSDP actions (``0SEND_F1``, ``1RECV_F1``,
``0UNSHARD``, ...). Which stages a rank owns is read from the compute actions of its row.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass

_COMPUTE = {"F", "B", "I", "W"}
_COMMS = {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"}
_CELL = re.compile(r"^(\d+)([A-Z_]+)(\d*)$")


@dataclass
class CsvLayout:
    format: str  # "compute_only" | "compute_comms"
    num_stages: int
    num_microbatches: int
    stages_by_rank: list  # list of stage-index lists, one per rank


def read_csv_layout(path: str) -> CsvLayout:
    """Parse and check a schedule CSV; ``ValueError`` names the row, column and cell."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = [row for row in csv.reader(f) if any(c.strip() for c in row)]
    if not rows:
        raise ValueError(f"pipeline.pp_schedule_csv={path!r}: the file has no actions")
    has_comms = False
    owner: dict[int, int] = {}
    stages_by_rank: list[list[int]] = []
    microbatches: set[int] = set()
    for r, row in enumerate(rows):
        mine: list[int] = []
        for c, cell in enumerate(row):
            cell = cell.strip()
            if not cell:
                continue
            m = _CELL.match(cell)
            kind = m.group(2) if m else None
            if m is None or kind not in _COMPUTE | _COMMS or (kind in _COMPUTE and not m.group(3)):
                raise ValueError(
                    f"pipeline.pp_schedule_csv={path!r}: row {r + 1}, column {c + 1}: {cell!r} "
                    "is not an action (expected <stage><type><micro-batch> such as 0F1, 1B0, "
                    "1I0, 1W0, or a comms action such as 0SEND_F1)")
            stage = int(m.group(1))
            if kind in _COMMS:
                has_comms = True
                continue
            microbatches.add(int(m.group(3)))
            if owner.setdefault(stage, r) != r:
                raise ValueError(f"pipeline.pp_schedule_csv={path!r}: stage {stage} appears on "
                                 f"rows {owner[stage] + 1} and {r + 1}; a stage runs on one rank")
            if stage not in mine:
                mine.append(stage)
        stages_by_rank.append(sorted(mine))
    num_stages = max(owner) + 1
    missing = sorted(set(range(num_stages)) - set(owner))
    if missing:
        raise ValueError(f"pipeline.pp_schedule_csv={path!r}: stages {missing} have no actions "
                         f"(stages 0..{num_stages - 1} must all appear)")
    return CsvLayout("compute_comms" if has_comms else "compute_only", num_stages,
                     max(microbatches) + 1, stages_by_rank)
