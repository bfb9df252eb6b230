"""A SLURM request that can never start (``automodel/launch/slurm_request.py``): the
partitions as ``scontrol show partition -o`` prints them, the refusal of what they cannot
hold, and the pending reasons that never pass. The same on the local SLURM cluster:
tests/launch/test_slurm_faults.py."""

import pytest

from automodel.launch.slurm_request import (
    NEVER_REASONS,
    Request,
    _minutes,
    parse_partitions,
    request_problem,
)

pytestmark = pytest.mark.fast

SCONTROL = (  # (two partitions of the local test cluster, as scontrol prints them)
    "PartitionName=two AllowGroups=ALL Default=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED "
    "Nodes=node[1-2] State=UP TotalCPUs=4 TotalNodes=2\n"
    "PartitionName=debug AllowGroups=ALL Default=YES MaxNodes=UNLIMITED MaxTime=UNLIMITED "
    "Nodes=localhost State=UP TotalCPUs=2 TotalNodes=1\n"
    "PartitionName=short Default=NO MaxNodes=8 MaxTime=1-00:30:00 TotalCPUs=64 TotalNodes=16\n")
KEYS = {"nodes": "hydra.launcher.nodes", "tasks_per_node": "hydra.launcher.tasks_per_node",
        "cpus_per_task": "hydra.launcher.cpus_per_task", "minutes": "hydra.launcher.timeout_min"}


def _ask(nodes=1, tasks=1, cpus=1, minutes=60, partition=None):
    return request_problem(Request(nodes, tasks, cpus, minutes, partition, KEYS),
                           parse_partitions(SCONTROL))


def test_the_partitions_and_their_limits_are_read():
    two, debug, short = parse_partitions(SCONTROL)
    assert (two.name, two.nodes, two.max_nodes, two.max_minutes, two.cpus_per_node,
            two.default) == ("two", 2, None, None, 2, False)
    assert debug.default and debug.nodes == 1
    assert (short.max_nodes, short.max_minutes, short.cpus_per_node) == (8, 1470, 4)
    assert [_minutes(t) for t in ("90", "1:30:00", "2-00:00:00", "00:00:30", "INFINITE")] == \
        [90, 90, 2880, 1, None]


def test_a_request_beyond_its_partition_is_refused_naming_key_limit_and_fix():
    assert _ask() is None and _ask(nodes=2, partition="two") is None
    why = _ask(nodes=2)  # (the default partition: debug, one node)
    assert why.startswith("hydra.launcher.nodes=2, but partition debug has 1 node")
    assert "hold the job forever" in why and "Ask for at most 1" in why
    assert "a partition where it fits: two, short" in why
    assert "MaxNodes" in _ask(nodes=9, partition="short")
    why = _ask(minutes=2000, partition="short")
    assert why.startswith("hydra.launcher.timeout_min=2000, but partition short allows 1470")
    why = _ask(tasks=2, cpus=2)
    assert "asks for 4 CPUs per node, but the nodes of partition debug have 2" in why
    assert _ask(partition="elsewhere") is None  # (unknown here: SLURM answers)


def test_only_reasons_that_never_pass_are_acted_on():
    assert "PartitionConfig" in NEVER_REASONS and "PartitionTimeLimit" in NEVER_REASONS
    for waiting in ("Resources", "Priority", "ReqNodeNotAvail", "AssocMaxJobsLimit",
                    "BeginTime", "Dependency", "JobHeldUser"):
        assert waiting not in NEVER_REASONS
