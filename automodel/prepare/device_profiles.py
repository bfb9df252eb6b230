"""The device profile of the ranks a launch starts, for the planner (``layout=auto``, a
planned run): the local GPUs' (``nvidia-smi``'s name and memory), the nodes' of a SLURM
partition (``sinfo``: the GRES's GPU type, else the node's memory shared by its tasks), or CPU
ranks' own (the host's memory shared by the ranks; rough speeds: only their order matters,
and a run calibrates them, ``plan.calibrate_from``)."""

from __future__ import annotations

import dataclasses
import subprocess

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig


def cpu_profile(ranks: int):
    """The profile of CPU ranks: the host's memory shared by them, one node; rough speeds."""
    from automodel.costing.gpus import GiB, GpuProfile

    return GpuProfile("cpu", peak_bf16_flops=1e11, hbm_bytes=_host_memory() // ranks,
                      hbm_bandwidth=2e10, intra_node_bandwidth=2e9, inter_node_bandwidth=1e9,
                      gpus_per_node=ranks, compute_efficiency=0.5, overhead_bytes=GiB // 2)


def _host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("layout=auto on CPU ranks needs /proc/meminfo (the host's memory)")


GPU_PROFILES = (("H200", "h200"), ("H100", "h100_80gb"), ("A100", "a100_80gb"),
                ("B200", "b200"))


def gpu_profile(ranks: int):
    """The local GPUs' profile, from ``nvidia-smi``'s name and memory."""
    from automodel.costing.gpus import MiB, profile

    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    name, _, memory = out.stdout.splitlines()[0].partition(",")
    for part, known in GPU_PROFILES:
        if part in name:
            return profile(known, hbm_bytes=int(memory) * MiB, gpus_per_node=ranks)
    raise ConfigError(f"layout=auto: no planner profile for the local GPU {name.strip()!r} "
                      f"(profiles: {', '.join(k for _, k in GPU_PROFILES)}); plan it with "
                      "plan.py plan.gpu=<profile> plan.gpu_spec... and set the layout yourself")


def local_profile(cfg: TrainConfig):
    """The profile of the ranks a local launch starts: its GPUs', else its CPU ranks'."""
    world = cfg.layout.world_size
    return gpu_profile(world) if cfg.launch.gpus else cpu_profile(world)


def slurm_profile(partition: str | None, tasks_per_node: int):
    """The ranks of a SLURM job on ``partition``'s nodes (``sinfo``; None: the default
    partition): their GPUs' profile (the GRES's GPU type), else the node's memory shared by
    its tasks."""
    from automodel.costing.gpus import MiB

    args = ["sinfo", "-h", "-o", "%P|%G|%m"] + (["-p", partition] if partition else [])
    lines = [line.split("|") for line in
             subprocess.run(args, capture_output=True, text=True).stdout.split()]
    lines = [x for x in lines if partition or x[0].endswith("*")]  # (the default partition)
    if not lines:
        raise ConfigError("layout=auto: sinfo names no nodes for this job's partition")
    _, gres, memory = lines[0]
    if gres not in ("(null)", ""):
        return gres_profile(gres, tasks_per_node)
    profile = cpu_profile(tasks_per_node)
    return dataclasses.replace(profile, hbm_bytes=int(memory.rstrip("+")) * MiB
                               // tasks_per_node)


def gres_profile(gres: str, tasks_per_node: int):
    """The GPU profile of a node's GRES as sinfo prints it (``gpu:h100:8(S:0-1)``,
    ``gpu:a100_80gb:4``): its type names the profile, its tasks the GPUs per node."""
    from automodel.costing.gpus import profile

    for entry in gres.split(","):
        parts = entry.split("(")[0].split(":")
        if parts[0] != "gpu":
            continue
        kind = parts[1].lower() if len(parts) == 3 else ""
        for part, known in GPU_PROFILES:
            if kind.startswith(part.lower()):
                return profile(known, gpus_per_node=tasks_per_node)
        raise ConfigError(
            f"layout=auto: the nodes' GRES {gres!r} names no GPU type the planner has a profile "
            f"for ({', '.join(k for _, k in GPU_PROFILES)}); plan with plan.py plan.search=true "
            "plan.gpus=<GPUs> plan.gpu=<profile> and set the layout (drop layout=auto)")
    raise ConfigError(f"layout=auto: the nodes' GRES {gres!r} holds no GPU (gpu:<type>:<n>); "
                      "plan with plan.py plan.search=true plan.gpus=<GPUs> and set the layout")
