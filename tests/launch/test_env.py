"""Which launcher started a process, read from its environment."""

import pytest

from automodel.config.launch_env import detect_launch_env

# fast: no process, no process group (pytest -m fast)
pytestmark = pytest.mark.fast

SRUN_TASK = {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SUBMITIT_EXECUTOR": "slurm"}


def test_srun_task_is_a_rank_and_knows_when_it_was_requeued():
    first = detect_launch_env(SRUN_TASK)
    assert (first.kind, first.world_size, first.local_world_size, first.rank,
            first.restarts) == ("slurm", 2, 2, 1, 0)
    assert detect_launch_env({**SRUN_TASK, "SLURM_RESTART_COUNT": "2"}).restarts == 2


def test_torchrun_and_local():
    torchrun = detect_launch_env({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4",
                                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    assert (torchrun.kind, torchrun.world_size, torchrun.rank) == ("torchrun", 4, 3)
    assert detect_launch_env({}).kind == "local" and detect_launch_env({}).restarts == 0


def test_a_rank_runs_its_share_of_the_cpus_unless_told():
    from automodel.config.launch_env import rank_threads

    assert rank_threads({}, 16, 8) == 2  # the node's CPUs shared by its ranks
    assert rank_threads({}, 2, 4) == 1  # never 0
    assert rank_threads({"SLURM_CPUS_PER_TASK": "6"}, 96, 8) == 6  # what SLURM gave the task
    assert rank_threads({"SLURM_CPUS_PER_TASK": "6", "OMP_NUM_THREADS": "3"}, 96, 8) == 3
    assert rank_threads({"OMP_NUM_THREADS": "3", "AUTOMODEL_NUM_THREADS": "5"}, 96, 8) == 5
    assert rank_threads({"OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": "x"}, 8, 2) == 4
