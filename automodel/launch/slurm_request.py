"""A SLURM request that can never start: refused before it is submitted where the partition's
own limits show it, reported (and cancelled) as soon as SLURM gives its reason otherwise.

Without this, ``hydra.launcher.nodes=2`` on a partition of one node is accepted by sbatch
and pends forever (reason ``PartitionConfig``) while the launcher waits and prints nothing.
No torch; the SLURM commands are ``scontrol`` and ``squeue``.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

# squeue's pending reasons of a job that no amount of waiting will start: the request is
# beyond a limit of its partition, association or QOS, or names what does not exist
NEVER_REASONS = frozenset({
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
    "InvalidAccount", "InvalidQOS", "QOSMaxNodePerJobLimit", "QOSMaxCpuPerJobLimit",
    "QOSMaxWallDurationPerJobLimit", "QOSMaxGRESPerJob", "AssocMaxNodesPerJobLimit",
    "AssocMaxCpuPerJobLimit", "AssocMaxWallDurationPerJobLimit", "AssocMaxGRESPerJob"})


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int  # TotalNodes
    max_nodes: int | None  # MaxNodes per job (None: unlimited)
    max_minutes: int | None  # MaxTime (None: unlimited)
    cpus_per_node: int | None  # TotalCPUs / TotalNodes (None: unknown)
    default: bool


def parse_partitions(text: str) -> list[Partition]:
    """``scontrol show partition -o``: one partition per line of ``Key=Value`` pairs."""
    found = []
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "PartitionName" not in fields:
            continue
        nodes = int(fields.get("TotalNodes", 0) or 0)
        cpus = int(fields.get("TotalCPUs", 0) or 0)
        found.append(Partition(
            fields["PartitionName"], nodes, _limit(fields.get("MaxNodes")),
            _minutes(fields.get("MaxTime")), cpus // nodes if nodes and cpus else None,
            fields.get("Default") == "YES"))
    return found


def _limit(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _minutes(value: str | None) -> int | None:
    """SLURM's time limits (``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``, ``UNLIMITED``) in minutes."""
    if not value or not value[0].isdigit():
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if len(parts) == 1:
        parts = [0, parts[0], 0]  # (minutes alone)
    while len(parts) < 3:
        parts.insert(0, 0)
    hours, minutes, seconds = parts
    return (int(days or 0) * 24 + hours) * 60 + minutes + (1 if seconds else 0)


@dataclass(frozen=True)
class Request:
    """What a job asks SLURM for, under the names of the launcher that takes it."""

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    minutes: int | None
    partition: str | None
    keys: dict  # the launcher's name of each field: {"nodes": "hydra.launcher.nodes", ...}


def request_problem(request: Request, partitions: list[Partition]) -> str | None:
    """Why ``request`` can never start on its partition, with the fix; None when it can (or
    the partition is not known here: SLURM's own answer then decides)."""
    chosen = [p for p in partitions if (p.name == request.partition if request.partition
                                        else p.default)]
    if not chosen:
        return None
    part = chosen[0]
    others = [p.name for p in partitions
              if p is not part and _limit_passed(request, p, "") is None]
    return _limit_passed(request, part, f", or a partition where it fits: {', '.join(others)}"
                         if others else "")


def _limit_passed(request: Request, part: Partition, elsewhere: str) -> str | None:
    """The first limit of ``part`` that ``request`` passes, in words ending in ``elsewhere``
    (where else it fits), or None."""
    k, where = request.keys, f"partition {part.name}"
    if request.nodes > part.nodes:
        return (f"{k['nodes']}={request.nodes}, but {where} has {part.nodes} node"
                f"{'s' if part.nodes != 1 else ''}: SLURM would hold the job forever (a "
                f"pending reason such as PartitionNodeLimit). Ask for at most {part.nodes}"
                f"{elsewhere}")
    if part.max_nodes is not None and request.nodes > part.max_nodes:
        return (f"{k['nodes']}={request.nodes}, but {where} allows {part.max_nodes} per job "
                f"(MaxNodes): SLURM would hold the job forever (reason PartitionNodeLimit)"
                f"{elsewhere}")
    if part.max_minutes is not None and request.minutes and request.minutes > part.max_minutes:
        return (f"{k['minutes']}={request.minutes}, but {where} allows {part.max_minutes} "
                f"minutes (MaxTime): SLURM would hold the job forever (reason "
                f"PartitionTimeLimit). Ask for at most {part.max_minutes}{elsewhere}")
    cpus = request.tasks_per_node * request.cpus_per_task
    if part.cpus_per_node is not None and cpus > part.cpus_per_node:
        return (f"{k['tasks_per_node']}={request.tasks_per_node} x {k['cpus_per_task']}="
                f"{request.cpus_per_task} asks for {cpus} CPUs per node, but the nodes of "
                f"{where} have {part.cpus_per_node}{elsewhere}")
    return None


def check_request(request: Request) -> str | None:
    """``request_problem`` against this cluster's partitions (None where ``scontrol`` cannot
    tell: not on a SLURM login node, or it failed)."""
    try:
        out = subprocess.run(["scontrol", "show", "partition", "-o"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return request_problem(request, parse_partitions(out.stdout))


def pending_reasons(job_ids: list[str]) -> dict[str, str]:
    """{job id: squeue's reason} of the jobs among ``job_ids`` that are pending (array tasks
    under their own ids); empty when squeue cannot answer."""
    if not job_ids:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-t", "PENDING", "-o", "%i|%r", "-j",
                              ",".join(job_ids)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    reasons = {}
    for line in out.stdout.splitlines():
        job, _, reason = line.strip().partition("|")
        if job:
            reasons[job] = reason.strip()
    return reasons


def cancel_jobs_that_never_start(job_ids: list[str], reported: set) -> None:
    """Cancel each pending job whose reason is in ``NEVER_REASONS``, saying why and what to
    change (once per job: ``reported`` keeps the ids)."""
    for job, reason in pending_reasons(job_ids).items():
        if reason not in NEVER_REASONS or job in reported:
            continue
        reported.add(job)
        detail = subprocess.run(["scontrol", "show", "job", job.split("_")[0]],
                                capture_output=True, text=True).stdout
        asked = " ".join(re.findall(r"\b(?:NumNodes|NumCPUs|TimeLimit|Partition)=\S+", detail))
        print(f"automodel: SLURM job {job} can never start (reason {reason}: its request, "
              f"{asked or 'see scontrol show job ' + job}, is beyond a limit of its partition, "
              f"account or QOS); cancelling it. Ask for less (hydra.launcher.nodes, "
              f"tasks_per_node, timeout_min, partition: scontrol show partition lists the "
              f"limits)", file=sys.stderr, flush=True)
        subprocess.run(["scancel", job], capture_output=True)
