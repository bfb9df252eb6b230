"""A SLURM task's place in its job, read from SLURM's own variables: no torch, no submitit, no
``scontrol``. One reading serves a plain ``srun python train.py ...`` in a batch script and
the tasks of a submitit job alike.

- rank, world size: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``);
- local rank, ranks on this node: ``SLURM_LOCALID``, this node's entry (``SLURM_NODEID``) of
  ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``), e.g. ``8(x2)`` or ``2,1``;
- the rendezvous host: the first node of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``),
  where SLURM starts task 0 (block distribution, SLURM's default);
- the rendezvous port: derived from the job id and step id, so every task computes the same one
  and two jobs (or two steps of one job) that run at the same time get different ones.

``MASTER_ADDR`` / ``MASTER_PORT`` already in the environment are kept: a site or user that
sets them chooses.
"""

from __future__ import annotations

import itertools
import re
import zlib
from dataclasses import dataclass
from typing import Mapping

# Rendezvous ports: below Linux's ephemeral range (32768-60999), where outgoing connections
# take their local ports, and above the usual services.
PORT_BASE, PORT_SPAN = 20000, 12000
_STEPS = 8  # consecutive job ids keep distinct ports for this many steps each


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list in full: ``gpu-[01-03,07],login1`` -> ``gpu-01 gpu-02
    gpu-03 gpu-07 login1`` (zero padding kept; several bracket groups in one name multiply,
    as ``scontrol show hostnames`` does)."""
    hosts: list[str] = []
    for name in _top_level_items(text):
        parts = re.split(r"\[([^\]]*)\]", name)  # text, ranges, text, ranges, ..., text
        choices = [[p] if i % 2 == 0 else _ranges(p, text) for i, p in enumerate(parts)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _top_level_items(text: str) -> list[str]:
    """The comma-separated names of a host list, commas inside brackets kept."""
    items, depth, current = [], 0, ""
    for ch in text.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise ValueError(f"SLURM host list {text!r}: unbalanced brackets")
    return [item for item in items + [current] if item]


def _ranges(spec: str, text: str) -> list[str]:
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise ValueError(f"SLURM host list {text!r}: cannot read the range {part!r}")
        low, high = m.group(1), m.group(2) or m.group(1)
        width = len(low)  # "01-10": two digits, as SLURM pads them
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``'s form in full: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"SLURM tasks per node {text!r}: cannot read {part!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def rendezvous_port(job_id: str, step_id: str) -> int:
    """The port of a job step's rendezvous, the same on every task of the step."""
    step = int(step_id) if str(step_id).isdigit() else 0
    key = int(job_id) if str(job_id).isdigit() else zlib.crc32(str(job_id).encode())
    return PORT_BASE + (key * _STEPS + step % _STEPS) % PORT_SPAN


@dataclass(frozen=True)
class SlurmTask:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # the tasks of this task's node


def _first(env: Mapping[str, str], *names: str, default: str | None = None) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    if default is None:
        raise ValueError(f"this SLURM task's environment has none of {', '.join(names)}: "
                         "start the ranks with srun inside a SLURM allocation")
    return default


def slurm_task(env: Mapping[str, str]) -> SlurmTask:
    """This task's place in its SLURM job step, from ``env`` (see the module's docstring)."""
    world = int(_first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default="1"))
    per_node = expand_tasks_per_node(_first(env, "SLURM_STEP_TASKS_PER_NODE",
                                            "SLURM_TASKS_PER_NODE", default=str(world)))
    node = int(env.get("SLURM_NODEID") or 0)
    local_world = per_node[node] if node < len(per_node) else per_node[0]
    return SlurmTask(int(env.get("SLURM_PROCID") or 0), world, int(env.get("SLURM_LOCALID") or 0),
                     local_world)


def rank_environment(env: Mapping[str, str]) -> dict:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT of this task,
    as torch's ``env://`` start and automodel read them."""
    task = slurm_task(env)
    addr = env.get("MASTER_ADDR") or expand_hostlist(
        _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))[0]
    port = env.get("MASTER_PORT") or rendezvous_port(
        _first(env, "SLURM_JOB_ID", "SLURM_JOBID"), env.get("SLURM_STEP_ID", "0"))
    return {"RANK": str(task.rank), "WORLD_SIZE": str(task.world_size),
            "LOCAL_RANK": str(task.local_rank), "LOCAL_WORLD_SIZE": str(task.local_world_size),
            "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
