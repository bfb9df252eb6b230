"""A SLURM task's rank, world, node and rendezvous from SLURM's own variables (a plain srun
and a submitit task alike), which GPU a rank takes, and the refusal of a CPU build of torch
where the job has GPUs. The variables are those a real srun task of the test cluster has
(``srun -p two -N 2 --ntasks-per-node=2 env``); the multi-node runs themselves are in
tests/launch/test_recipes_slurm.py."""

import pytest

from automodel.api import load_config
from automodel.checks.preflight import preflight
from automodel.config.build import ConfigError
from automodel.config.launch_env import cuda_device_index, detect_launch_env, slurm_gpus
from automodel.config.slurm_env import (
    PORT_BASE,
    PORT_SPAN,
    expand_hostlist,
    expand_tasks_per_node,
    rank_environment,
    rendezvous_port,
)
from tests.helpers import BASE

pytestmark = pytest.mark.fast

# Rank 3 of a plain `srun` (no submitit) on 2 nodes x 2 tasks: node2's second task.
PLAIN_SRUN = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_LOCALID": "1",
              "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NODELIST": "node[1-2]",
              "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3",
              "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]",
              "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4",
              "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)"}


@pytest.mark.parametrize("text,hosts", [
    ("node[1-2]", ["node1", "node2"]),
    ("localhost", ["localhost"]),
    ("gpu-[01-03,07],login1", ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "login1"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
    ("dgx[098-101]-ib,cpu7", ["dgx098-ib", "dgx099-ib", "dgx100-ib", "dgx101-ib", "cpu7"]),
])
def test_host_lists_expand_as_scontrol_show_hostnames_does(text, hosts):
    assert expand_hostlist(text) == hosts


def test_unreadable_host_lists_and_task_counts_are_named():
    with pytest.raises(ValueError, match=r"'node\[1-2': unbalanced"):
        expand_hostlist("node[1-2")
    with pytest.raises(ValueError, match="cannot read the range 'a-b'"):
        expand_hostlist("node[a-b]")
    with pytest.raises(ValueError, match="cannot read 'x'"):
        expand_tasks_per_node("2,x")


def test_tasks_per_node_expand():
    assert expand_tasks_per_node("8(x2)") == [8, 8]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]


def test_a_plain_srun_task_is_a_rank_with_the_first_node_as_rendezvous():
    """No SUBMITIT_EXECUTOR, no submitit JobEnvironment: what submitit's own helper refused
    ("Could not figure out which environment the job is runnning in")."""
    launch = detect_launch_env(PLAIN_SRUN)
    assert (launch.kind, launch.world_size, launch.local_world_size, launch.rank,
            launch.local_rank) == ("slurm", 4, 2, 3, 1)
    env = rank_environment(PLAIN_SRUN)
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "node1", "MASTER_PORT": str(rendezvous_port("1", "0"))}
    # every task of the step computes the same address and port
    task0 = {**PLAIN_SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    assert {k: rank_environment(task0)[k] for k in ("MASTER_ADDR", "MASTER_PORT")} == \
        {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT")}
    # a site's own MASTER_ADDR / MASTER_PORT are kept
    mine = rank_environment({**PLAIN_SRUN, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"})
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("10.0.0.5", "29500")
    # the step's node list comes before the job's (a step on some of the job's nodes)
    step = rank_environment({**PLAIN_SRUN, "SLURM_STEP_NODELIST": "node2"})
    assert step["MASTER_ADDR"] == "node2"


def test_uneven_nodes_give_each_node_its_own_local_world():
    env = {**PLAIN_SRUN, "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1",
           "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1"}
    assert rank_environment(env)["LOCAL_WORLD_SIZE"] == "1"
    assert rank_environment({**env, "SLURM_NODEID": "0"})["LOCAL_WORLD_SIZE"] == "2"


def test_batch_shell_and_single_task_start_local_ranks():
    """The batch script's own shell has no SLURM_STEP_ID; one srun task without submitit is
    one launcher process (it starts the node's local ranks itself)."""
    batch = {k: v for k, v in PLAIN_SRUN.items() if "STEP" not in k}
    assert detect_launch_env(batch).kind == "local"
    one = {**PLAIN_SRUN, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}
    assert detect_launch_env(one).kind == "local"


def test_ports_stay_apart_for_concurrent_jobs_and_steps_and_in_range():
    ports = {rendezvous_port(str(job), str(step)) for job in range(1000, 1400)
             for step in range(4)}
    assert len(ports) == 1600  # no two of 400 consecutive jobs x 4 steps share a port
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert rendezvous_port("1234", "0") == rendezvous_port("1234", "0")
    assert PORT_BASE <= rendezvous_port("12_3", "batch") < PORT_BASE + PORT_SPAN


@pytest.mark.parametrize("visible,local_rank,local_world,index", [
    (8, 5, 8, 5),   # the node's ranks share its 8 GPUs: cuda:LOCAL_RANK
    (1, 5, 8, 0),   # --gpus-per-task=1 / --gpu-bind=single:1: the one GPU it sees
    (1, 0, 1, 0),   # one process, one GPU
    (4, 1, 2, 1),   # more GPUs than ranks
])
def test_each_rank_takes_its_own_gpu(visible, local_rank, local_world, index):
    assert cuda_device_index(visible, local_rank, local_world) == index


@pytest.mark.parametrize("visible,local_rank,local_world", [(2, 5, 8), (2, 0, 8), (4, 4, 8)])
def test_too_few_gpus_for_a_rank_is_refused(visible, local_rank, local_world):
    with pytest.raises(ValueError, match=rf"local rank {local_rank} of the {local_world} ranks "
                                         rf"on this node sees {visible} GPU\(s\).*"
                                         r"--gpus-per-task=1"):
        cuda_device_index(visible, local_rank, local_world)


def test_slurm_gpus_are_read_from_its_variables():
    assert slurm_gpus({"SLURM_GPUS_ON_NODE": "8"}) == 8
    assert slurm_gpus({"SLURM_JOB_GPUS": "0,1,2,3"}) == 4
    assert slurm_gpus({"SLURM_STEP_GPUS": "3"}) == 1
    assert slurm_gpus({}) == 0


GPU_NODE_TASK = {**PLAIN_SRUN, "SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16",
                 "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_LOCALID": "5",
                 "SLURM_PROCID": "13"}


def _preflight(env, tmp_path, *extra):
    cfg = load_config(BASE + ["parallelism=fsdp2", "trainer.global_batch_size=16", *extra],
                      str(tmp_path), env=env)
    preflight(cfg)


def test_a_cpu_build_of_torch_on_a_gpu_node_is_refused_before_training(tmp_path, monkeypatch):
    """The GPUs are the node's device files (the probe the tests patch) or SLURM's allocation,
    with no device file here. The build is taken for a CPU build (the one setup.sh installs
    here; the drift run of scripts/newest.sh installs PyPI's CUDA build, also on this CPU)."""
    monkeypatch.setattr("automodel.checks.support.torch_build", lambda: ("2.13.0+cpu", False))
    fix = r"AUTOMODEL_TORCH=cuda bash scripts/setup\.sh"
    with pytest.raises(ConfigError, match=r"\(8 given by SLURM .*\) but the installed torch "
                                          rf".* is a CPU build.*{fix}"):
        _preflight({**GPU_NODE_TASK, "SLURM_GPUS_ON_NODE": "8"}, tmp_path)
    monkeypatch.setattr("automodel.config.launch_env.gpu_device_probe", lambda: 8)
    with pytest.raises(ConfigError, match=rf"\(8 visible\).*{fix}"):
        _preflight(GPU_NODE_TASK, tmp_path)
    with pytest.raises(ConfigError, match=fix):  # a local launch on a GPU machine too
        _preflight({}, tmp_path)
    # the CPU on purpose, or no GPU: no refusal
    _preflight(GPU_NODE_TASK, tmp_path, "distributed.backend=gloo")
    monkeypatch.setattr("automodel.config.launch_env.gpu_device_probe", lambda: 0)
    _preflight(PLAIN_SRUN, tmp_path)


def test_gpu_binding_is_checked_before_training(tmp_path, monkeypatch):
    """With a CUDA build (mocked: this machine's torch is a CPU build, and has no GPU) a task
    that sees too few GPUs for its local rank is refused; one that sees one GPU passes."""
    monkeypatch.setattr("automodel.checks.support.torch_build", lambda: ("2.13.0+cu128", True))
    monkeypatch.setattr("automodel.config.launch_env.gpu_device_probe", lambda: 8)
    _preflight({**GPU_NODE_TASK, "CUDA_VISIBLE_DEVICES": "5"}, tmp_path)  # its own GPU
    _preflight(GPU_NODE_TASK, tmp_path)  # the node's 8: cuda:5
    with pytest.raises(ConfigError, match=r"local rank 5 of the 8 ranks on this node sees 2 "):
        _preflight({**GPU_NODE_TASK, "CUDA_VISIBLE_DEVICES": "4,5"}, tmp_path)


def test_a_failed_job_is_not_waited_for_its_result_files():
    """submitit waits 15 s for the result file of a finished job (a slow shared file system
    shows it late); a task SLURM killed writes none, so for a job SLURM reports failed the
    launchers wait FAILED_RESULT_WAIT_S only (a completed job keeps the 15 s)."""
    from submitit.slurm.slurm import SlurmJob

    from automodel.launch.slurm import FAILED_RESULT_WAIT_S, job_states_refreshed

    class Watcher:
        def get_state(self, job_id, mode):
            assert mode == "cache"  # (no sacct call of its own)
            return {"1": "FAILED", "2": "CANCELLED by 0", "3": "COMPLETED"}[job_id]

    class Job:
        watcher = Watcher()

        def __init__(self, job_id):
            self.job_id = job_id

    with job_states_refreshed(every_s=3600):
        wait = SlurmJob.__dict__["_results_timeout_s"]
        assert [wait.__get__(Job(i), Job) for i in "123"] == \
            [FAILED_RESULT_WAIT_S, FAILED_RESULT_WAIT_S, 15]
    assert "_results_timeout_s" not in SlurmJob.__dict__ and SlurmJob._results_timeout_s == 15
