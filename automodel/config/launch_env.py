"""Which launcher started this process, and how many GPUs it may use, read from the
environment and the device files. No torch."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from automodel.config.slurm_env import slurm_task


@dataclass
class LaunchEnv:
    kind: str  # "torchrun" (any torch elastic agent) | "slurm" (srun tasks) | "local"
    world_size: Optional[int] = None  # known only when an outer launcher started the ranks
    local_world_size: Optional[int] = None
    rank: int = 0
    restarts: int = 0  # how often SLURM requeued this job (it then resumes by itself)
    gpus: int = 0  # CUDA GPUs visible to this process (visible_gpu_count)
    local_rank: int = 0  # this rank's place on its node (torchrun, SLURM)
    gpus_allocated: int = 0  # GPUs SLURM gave this node or task (slurm_gpus), seen or not

    @property
    def external(self) -> bool:
        return self.kind != "local"


_GPU_DEVICE_FILE = re.compile(r"nvidia[0-9]+")  # not nvidiactl, nvidia-uvm, nvidia-modeset


def nvidia_device_files(dev: str = "/dev") -> int:
    """How many GPUs the NVIDIA driver exposes to this machine or container: its device files
    /dev/nvidia0, /dev/nvidia1, ... (a container gets the files of its GPUs only). Reading a
    directory costs nothing; torch.cuda (or nvidia-smi) would take seconds and, in the
    launching process, torch must not be imported before the configuration is checked."""
    try:
        names = os.listdir(dev)
    except OSError:
        return 0
    return sum(1 for name in names if _GPU_DEVICE_FILE.fullmatch(name))


# The machine's probe; tests/conftest.py replaces it so that tests describe a CPU machine
# unless they pass their own.
gpu_device_probe: Callable[[], int] = nvidia_device_files


def _ordinal(entry: str) -> int:
    """CUDA reads each CUDA_VISIBLE_DEVICES entry like strtoul: leading digits, else -1."""
    digits = re.match(r"[+-]?[0-9]+", entry.strip())
    return int(digits.group()) if digits else -1


def visible_gpu_count(env: Mapping[str, str], probe: Optional[Callable[[], int]] = None) -> int:
    """CUDA GPUs this process may use, as CUDA would count them (torch's own parser,
    torch.cuda._parse_visible_devices, follows the same rules), without importing torch.

    ``probe()`` counts the machine's GPUs (default: ``nvidia_device_files``); none means no
    driver, hence 0 whatever CUDA_VISIBLE_DEVICES says. CUDA_VISIBLE_DEVICES unset: all of
    them. Set: a comma list read up to the first invalid entry (empty, negative such as "-1",
    not a number such as "NoDevFiles"; then up to the first index beyond the machine's GPUs);
    a repeated entry makes the list empty. ``GPU-<uuid>`` entries count as listed (at most the
    machine's GPUs); ``MIG-<uuid>`` entries give 1 (CUDA enumerates one MIG instance per
    process).
    """
    physical = (probe or gpu_device_probe)()
    if physical <= 0:
        return 0
    var = env.get("CUDA_VISIBLE_DEVICES")
    if var is None:
        return physical
    entries = [e.strip() for e in var.split(",")]
    if entries[0].startswith(("GPU-", "MIG-")):
        prefix = entries[0][:4]
        listed: list = []
        for e in entries:
            if not e.startswith(prefix):
                break
            if e in listed:
                return 0
            listed.append(e)
        return 1 if prefix == "MIG-" else min(len(listed), physical)
    ordinals: list = []
    for e in entries:
        n = _ordinal(e)
        if n < 0:
            break
        if n in ordinals:
            return 0
        ordinals.append(n)
    for i, n in enumerate(ordinals):  # an index the machine does not have ends the list
        if n >= physical:
            return i
    return len(ordinals)


def detect_launch_env(env: Mapping[str, str],
                      gpu_probe: Optional[Callable[[], int]] = None) -> LaunchEnv:
    """``gpu_probe``: counts the machine's GPUs (see ``visible_gpu_count``)."""
    launch = _launcher(env)
    launch.gpus = visible_gpu_count(env, gpu_probe)
    launch.gpus_allocated = slurm_gpus(env)
    return launch


def _launcher(env: Mapping[str, str]) -> LaunchEnv:
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env
                                        and "MASTER_ADDR" in env):
        return LaunchEnv("torchrun", int(env["WORLD_SIZE"]),
                         int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])), int(env["RANK"]),
                         local_rank=int(env.get("LOCAL_RANK") or 0))
    # srun tasks (several, or a submitit job): every task is one rank. (A batch script's own
    # shell has no SLURM_STEP_ID: `python train.py` there starts local ranks.)
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    if "SLURM_STEP_ID" in env and (ntasks > 1 or env.get("SUBMITIT_EXECUTOR") == "slurm"):
        task = slurm_task(env)
        return LaunchEnv("slurm", task.world_size, task.local_world_size, task.rank,
                         int(env.get("SLURM_RESTART_COUNT") or 0), local_rank=task.local_rank)
    return LaunchEnv("local")


def slurm_gpus(env: Mapping[str, str]) -> int:
    """GPUs SLURM allocated to this node or task (0 outside SLURM, or without GPUs):
    ``SLURM_GPUS_ON_NODE``, else the ids of ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS``."""
    on_node = env.get("SLURM_GPUS_ON_NODE", "")
    if on_node.strip().isdigit():
        return int(on_node)
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        ids = [i for i in env.get(name, "").split(",") if i.strip()]
        if ids:
            return len(ids)
    return 0


def cuda_device_index(visible: int, local_rank: int, local_world: int) -> int:
    """The CUDA device a rank uses, given the GPUs it sees (``visible``), its local rank and
    the ranks of its node. Ranks of a node that see all of its GPUs take ``cuda:LOCAL_RANK``; a
    rank that sees exactly one GPU (SLURM's ``--gpus-per-task=1``, ``--gpu-bind=single:1``, a
    container per rank) takes that one. Anything else would put two ranks on one GPU or a rank
    on none: ``ValueError`` naming the counts and the fixes."""
    if visible == 1:
        return 0
    if visible >= local_world and local_rank < visible:
        return local_rank
    raise ValueError(
        f"local rank {local_rank} of the {local_world} ranks on this node sees {visible} "
        "GPU(s) (CUDA_VISIBLE_DEVICES, the GPUs the launcher gave it): each rank needs either "
        f"all of its node's GPUs, one per local rank (at least {local_world} visible, e.g. "
        f"SLURM's --gpus-per-node={local_world}), or exactly one GPU of its own "
        "(--gpus-per-task=1); or start one rank per GPU it sees")


THREADS_ENV = "AUTOMODEL_NUM_THREADS"  # a rank's intra-op threads, set by its launcher or user


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a cgroup's or taskset's limit),
    not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity call on this platform)
        return os.cpu_count() or 1


def rank_threads(env: Mapping[str, str], cpus: int, local_ranks: int) -> int:
    """The intra-op threads of one rank: ``AUTOMODEL_NUM_THREADS``, else ``OMP_NUM_THREADS``,
    else the CPUs SLURM gave the task (``SLURM_CPUS_PER_TASK``), else this process's ``cpus``
    shared by the ``local_ranks`` ranks of its node. torch's own default is every core in each
    rank: ranks sharing cores then run several threads per core, and the idle ones spin
    (measured on 2 cores, 2 ranks of tiny models: 2.7x the CPU time of one thread each, and
    twice the wall time)."""
    for name in (THREADS_ENV, "OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        value = str(env.get(name, "")).strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, cpus // max(1, local_ranks))
