"""The CPU set runs on the CPU under gloo on any machine, one with NVIDIA GPUs too.

There, scripts/setup.sh installs a CUDA build of torch, and a job with the default backend
(null) takes nccl and one rank per GPU on cuda:LOCAL_RANK: on a 1-GPU machine rank 1 has no
device, and CUDA numbers would be compared with the stored CPU ones (tests/golden). So every
job the test helpers start carries ``tests.helpers.ON_CPU`` (``distributed.backend=gloo``).

Checked here on a machine that reports GPUs, which this one cannot be: its GPU count is a probe
(as in tests/config/test_gpu_defaults.py), and in the ranks ``torch.cuda.is_available`` is
patched to return True. That mocks hardware that does not exist here (no GPU, a CPU build of
torch); any CUDA call the job made would then raise. The tests about GPUs: tests/test_gpu.py.
"""

import pytest
import torch

from automodel.api import load_config
from automodel.distributed.init import backend_and_device
from tests.cli.test_cli import QUICK, cli_args
from tests.distributed.test_parity import assert_matches
from tests.helpers import BASE, FP32, job_overrides, run_on_ranks

PROBE = "automodel.config.launch_env.gpu_device_probe"
CPU = torch.device("cpu")


@pytest.fixture
def eight_gpus(monkeypatch):
    """This machine reports 8 NVIDIA GPUs, to config resolution and to torch.cuda (mocked)."""
    monkeypatch.setattr(PROBE, lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


TORCHRUN = {"TORCHELASTIC_RUN_ID": "r", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1"}
SRUN_TASK = {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SUBMITIT_EXECUTOR": "slurm"}


@pytest.mark.fast
def test_every_job_the_helpers_start_resolves_to_gloo_on_the_cpu(eight_gpus, tmp_path):
    jobs = {  # the overrides each helper composes, where its ranks run, how many
        "tests.helpers.train": (job_overrides(["parallelism=fsdp2"]), {}, 2),
        "the reference fixture": (job_overrides(["parallelism=none"]), {}, 1),
        "tests.cli.test_cli.run": (cli_args(["parallelism=hsdp"] + QUICK), {}, 4),
        "its torchrun commands": (cli_args(["parallelism=ddp"] + QUICK), TORCHRUN, 2),
        "its SLURM commands": (cli_args(["parallelism=fsdp2"] + QUICK), SRUN_TASK, 2),
    }
    for name, (overrides, env, ranks) in jobs.items():
        cfg = load_config(overrides, str(tmp_path), env=env)
        assert cfg.distributed.backend == "gloo", name
        assert cfg.world_size == ranks, name  # the CPU defaults, not one rank per GPU
        for local_rank in range(ranks):
            assert backend_and_device(cfg.distributed.backend, local_rank) == ("gloo", CPU)
    # A test that names a backend keeps it.
    assert cli_args(["distributed.backend=nccl"]) == ["distributed.backend=nccl"]
    # The pin is what keeps them there: without it the same job takes a rank per GPU, nccl,
    # and cuda:LOCAL_RANK.
    cfg = load_config(BASE + ["parallelism=fsdp2"], str(tmp_path))
    assert cfg.distributed.nproc_per_node == 8
    assert backend_and_device(cfg.distributed.backend, 1) == ("nccl", torch.device("cuda", 1))


def _rank_on_a_machine_with_gpus(rank, world, cfg):
    """A rank of a pinned job where torch.cuda reports a GPU (mocked: see the docstring)."""
    from automodel.distributed.init import init_distributed
    from automodel.recipes.train import train

    asked = []

    def available():
        asked.append(True)
        return True

    torch.cuda.is_available = available
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_minutes,
                            need_group=True)
    records = train(cfg, info)
    return info.backend, info.device, bool(asked), records


def test_a_pinned_job_trains_on_the_cpu_where_cuda_is_available(eight_gpus, reference, tmp_path):
    cfg = load_config(job_overrides(["parallelism=fsdp2", FP32]), str(tmp_path))
    assert cfg.distributed.nproc_per_node == 2
    out = run_on_ranks(_rank_on_a_machine_with_gpus, 2, cfg, tmp_path=tmp_path)
    for backend, device, asked, _ in out:
        assert (backend, device, asked) == ("gloo", CPU, True)
    # (no CUDA call was made: this build of torch would have raised) and the numbers are the
    # CPU numbers of the single-process reference
    assert_matches(out[0][3], reference())
