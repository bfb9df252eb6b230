"""The ``plan`` node of ``plan.py`` (``conf/plan.yaml``): which accelerator to plan for, and
what to search. Torch-free, like every schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class PlanConfig:
    gpu: str = "h100_80gb"  # a GPU profile: h100_80gb | h200 | a100_80gb | b200
    # any number of the profile replaced: plan.gpu_spec.inter_node_bandwidth=25e9, ...
    gpu_spec: Dict[str, Any] = field(default_factory=dict)
    # measured numbers that replace the model's: compute_efficiency, comm_efficiency,
    # bandwidth.<axis> (bus bytes/s)
    calibration: Dict[str, Any] = field(default_factory=dict)
    # a planned run's folder (its plan_check.json): plan on the device it ran on, with the
    # efficiencies at which its plan's step time was its measured one (plan.calibration's
    # keys still win)
    calibrate_from: Optional[str] = None
    gpus: Optional[int] = None  # the job's GPUs (= ranks); null: the mesh's product
    search: bool = False  # rank every layout of plan.gpus GPUs that fits, print the best
    top: int = 5  # layouts the search prints
    workers: Optional[int] = None  # processes simulating rank classes; null: the CPU count
    picture: bool = True  # plan.png beside plan.json
    # simulate every layer (slower); by default a deep model of alike layers is simulated as
    # two shallow copies, extended to its depth (automodel/planning/depth.py)
    full_depth: bool = False
