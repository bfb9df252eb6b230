"""How many local ranks a job gets on a machine with GPUs: one per visible GPU by default,
never more than the GPUs under NCCL; torchrun and SLURM decide for themselves. The machine is
faked: its GPU count is a probe (tests/conftest.py makes it 0 for every other test)."""

import pytest

from automodel.config.launch_env import detect_launch_env, nvidia_device_files, visible_gpu_count
from tests.config.test_resolve import cfg, error

# fast: no process, no process group (pytest -m fast)
pytestmark = pytest.mark.fast

TORCHRUN = {"TORCHELASTIC_RUN_ID": "r", "RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "x"}
SRUN_TASK = {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16",
             "SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_PROCID": "3", "SUBMITIT_EXECUTOR": "slurm"}


@pytest.fixture
def machine(monkeypatch):
    """machine(n): from now on this machine has n GPUs (n device files /dev/nvidia<N>)."""
    def set_gpus(n: int):
        monkeypatch.setattr("automodel.config.launch_env.gpu_device_probe", lambda: n)
    return set_gpus


def ranks(c) -> tuple:
    return c.world_size, c.distributed.nproc_per_node


# ----------------------------------------------------------------------------- counting GPUs
@pytest.mark.parametrize("value, expected", [
    (None, 8),  # unset: every GPU of the machine
    ("", 0), ("-1", 0), ("NoDevFiles", 0),  # none visible
    ("0", 1), ("0,1", 2), (" 1, 2 ", 2), ("7,0,3", 3), ("1gpu,2", 2),  # strtoul, like CUDA
    ("0,1,-1,2", 2), ("0,,1", 1),  # the first invalid entry ends the list
    ("0,9", 1), ("9", 0), ("9,0", 0),  # an index the machine lacks ends it too
    ("0,0", 0), ("1,2,1", 0),  # a repeated index: no device at all (CUDA's and torch's rule)
    ("GPU-aaa,GPU-bbb", 2), ("GPU-aaa,GPU-aaa", 0), ("GPU-aaa,1", 1),
    ("MIG-aaa,MIG-bbb", 1),  # CUDA enumerates one MIG instance per process
])
def test_cuda_visible_devices(value, expected):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_gpu_count(env, probe=lambda: 8) == expected


def test_no_driver_means_no_gpu_whatever_cuda_visible_devices_says():
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1"}, probe=lambda: 0) == 0
    assert visible_gpu_count({}, probe=lambda: 0) == 0


def test_device_files_are_the_gpus_only(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidia12", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools",
                 "nvidia-modeset", "null"):
        (tmp_path / name).touch()
    (tmp_path / "nvidia-caps").mkdir()
    assert nvidia_device_files(str(tmp_path)) == 3
    assert nvidia_device_files(str(tmp_path / "missing")) == 0


def test_launch_env_carries_the_count():
    assert detect_launch_env({"CUDA_VISIBLE_DEVICES": "2,3"}, gpu_probe=lambda: 4).gpus == 2
    assert detect_launch_env({}, gpu_probe=lambda: 0).gpus == 0


# ----------------------------------------------------------------------------- default rank count
def test_no_gpu_keeps_the_cpu_defaults(machine):
    machine(0)
    assert ranks(cfg("parallelism=fsdp2")) == (2, 2)
    assert ranks(cfg("parallelism=ddp")) == (2, 2)
    assert ranks(cfg("parallelism=hsdp")) == (4, 4)
    assert ranks(cfg("parallelism=none")) == (1, 1)
    assert ranks(cfg("parallelism=fsdp2", "mesh.tp_size=2")) == (2, 2)


def test_one_gpu_one_rank(machine):
    machine(1)
    for strategy in ("fsdp2", "ddp", "none"):
        c = cfg(f"parallelism={strategy}")
        assert ranks(c) == (1, 1) and c.mesh.dp_size == 1 and c.launch.gpus == 1


def test_eight_gpus_eight_ranks(machine):
    machine(8)
    for strategy in ("fsdp2", "ddp"):
        c = cfg(f"parallelism={strategy}")
        assert ranks(c) == (8, 8) and c.mesh.dp_size == 8 and c.trainer.local_batch_size == 2
    assert ranks(cfg("parallelism=none")) == (1, 1)  # one process, whatever the machine


def test_eight_gpus_with_tp_and_pp(machine):
    machine(8)
    c = cfg("parallelism=fsdp2", "mesh.tp_size=2")
    assert (c.mesh.dp_size, c.mesh.tp_size, c.world_size) == (4, 2, 8)
    c = cfg("parallelism=fsdp2", "pipeline=1f1b")
    assert (c.mesh.dp_size, c.mesh.pp_size, c.world_size) == (4, 2, 8)
    c = cfg("parallelism=fsdp2", "pipeline=1f1b", "mesh.tp_size=2")
    assert (c.mesh.dp_size, c.mesh.tp_size, c.mesh.pp_size, c.world_size) == (2, 2, 2, 8)
    c = cfg("parallelism=hsdp")
    assert (c.mesh.dp_replicate_size, c.mesh.dp_size, c.world_size) == (2, 8, 8)


def test_gpus_not_divisible_by_the_model_parallel_sizes(machine):
    machine(8)
    msg = error("parallelism=fsdp2", "mesh.tp_size=3")
    assert "8 visible GPUs" in msg and "3*1*1 = 3" in msg
    assert "distributed.nproc_per_node" in msg and "mesh.dp_size" in msg


def test_cuda_visible_devices_decides(machine):
    machine(8)
    assert ranks(cfg("parallelism=ddp", env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})) == (4, 4)
    assert ranks(cfg("parallelism=fsdp2", env={"CUDA_VISIBLE_DEVICES": "3"})) == (1, 1)
    # empty: no GPU visible, so the CPU defaults (gloo) hold
    assert ranks(cfg("parallelism=hsdp", env={"CUDA_VISIBLE_DEVICES": ""})) == (4, 4)
    assert ranks(cfg("parallelism=hsdp", env={"CUDA_VISIBLE_DEVICES": "-1"})) == (4, 4)


def test_fewer_ranks_than_gpus_is_fine(machine):
    machine(8)
    assert ranks(cfg("parallelism=fsdp2", "distributed.nproc_per_node=4")) == (4, 4)
    assert ranks(cfg("parallelism=fsdp2", "mesh.dp_size=2")) == (2, 2)


def test_gloo_runs_ranks_on_cpu_with_the_cpu_defaults(machine):
    machine(8)
    assert ranks(cfg("parallelism=fsdp2", "distributed.backend=gloo")) == (2, 2)
    assert ranks(cfg("parallelism=fsdp2", "distributed.backend=gloo",
                     "distributed.nproc_per_node=16")) == (16, 16)


# ----------------------------------------------------------------------------- too many ranks
def test_more_ranks_than_gpus_refused(machine):
    machine(8)
    msg = error("parallelism=fsdp2", "distributed.nproc_per_node=16")
    assert "distributed.nproc_per_node=16" in msg and "8 GPUs are visible" in msg
    assert "distributed.nproc_per_node=8" in msg and "distributed.backend=gloo" in msg
    msg = error("parallelism=fsdp2", "mesh.dp_size=16", "distributed.backend=nccl")
    assert "mesh.dp_size" in msg and "16*1*1*1" in msg and "16 local ranks" in msg
    assert "8 GPUs are visible" in msg and "mesh.dp_size=8" in msg


def test_one_gpu_cannot_hold_a_pipeline_or_hsdp(machine):
    machine(1)
    msg = error("parallelism=fsdp2", "pipeline=1f1b")
    assert "2 local ranks" in msg and "1 GPU is visible" in msg and "1*1*1*2" in msg
    msg = error("parallelism=fsdp2", "mesh.tp_size=2")
    assert "2 local ranks" in msg and "1 GPU is visible" in msg
    msg = error("parallelism=hsdp")
    assert "mesh.dp_replicate_size=2" in msg and "1 GPU is visible" in msg


def test_nccl_without_gpus_refused(machine):
    machine(0)
    msg = error("parallelism=ddp", "distributed.backend=nccl")
    assert "distributed.backend=nccl" in msg and "0 GPUs are visible" in msg
    assert "distributed.backend=gloo" in msg
    # one process makes no process group: the backend is never used
    assert ranks(cfg("parallelism=none", "distributed.backend=nccl")) == (1, 1)


# ----------------------------------------------------------------------------- outer launchers
def test_torchrun_and_slurm_decide_for_themselves(machine):
    machine(1)  # more ranks than GPUs: theirs to place (and to refuse)
    c = cfg("parallelism=ddp", env=TORCHRUN)
    assert (c.launch.kind, c.mesh.dp_size, c.distributed.nproc_per_node) == ("torchrun", 4, None)
    c = cfg("parallelism=fsdp2", "mesh.tp_size=2", env=SRUN_TASK)
    assert (c.launch.kind, c.mesh.dp_size, c.world_size) == ("slurm", 8, 16)
    machine(8)
    c = cfg("parallelism=ddp", env=TORCHRUN)
    assert (c.mesh.dp_size, c.world_size) == (4, 4)
