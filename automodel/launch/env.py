"""Which launcher started this process, read from the environment. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass
class LaunchEnv:
    kind: str  # "torchrun" (any torch elastic agent) | "slurm" (srun tasks) | "local"
    world_size: Optional[int] = None  # known only when an outer launcher started the ranks
    local_world_size: Optional[int] = None
    rank: int = 0
    restarts: int = 0  # how often SLURM requeued this job (it then resumes by itself)

    @property
    def external(self) -> bool:
        return self.kind != "local"


def detect_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env
                                        and "MASTER_ADDR" in env):
        return LaunchEnv("torchrun", int(env["WORLD_SIZE"]),
                         int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])), int(env["RANK"]))
    # srun tasks (several, or a submitit job): every task is one rank.
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    if "SLURM_STEP_ID" in env and (ntasks > 1 or env.get("SUBMITIT_EXECUTOR") == "slurm"):
        local = int(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS_PER_NODE", "1"))
                    .split("(")[0].split(",")[0])
        return LaunchEnv("slurm", ntasks, local, int(env.get("SLURM_PROCID", "0")),
                         int(env.get("SLURM_RESTART_COUNT") or 0))
    return LaunchEnv("local")
