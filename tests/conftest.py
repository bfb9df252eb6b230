import os

import pytest

from tests.helpers import train

# Tests never reach a network: trackers offline, no hub downloads.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Keep tests independent of a torchrun/SLURM environment they may be started from.
for _var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "SLURM_PROCID"):
    os.environ.pop(_var, None)


@pytest.fixture(autouse=True)
def _wandb_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The single-process run every layout must match, keyed by extra overrides."""
    cache = {}

    def get(*extra):
        if extra not in cache:
            out = tmp_path_factory.mktemp("reference")
            cache[extra] = train(["parallelism=none", *extra], out)
        return cache[extra]

    return get


@pytest.fixture(autouse=True)
def _no_gpus(monkeypatch):
    """Tests describe a CPU machine: config resolution sees no GPU (whatever this machine has)
    unless a test passes its own probe (tests/config/test_gpu_defaults.py)."""
    monkeypatch.setattr("automodel.launch.env.gpu_device_probe", lambda: 0)
