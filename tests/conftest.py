import os

import pytest

from tests.helpers import WORKER_CPUS, train

# Tests never reach a network: trackers offline, no hub downloads.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist the workers share the cores: every process a worker starts runs its share
# (the launchers honour an explicit OMP_NUM_THREADS: automodel.config.launch_env.rank_threads).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_CPUS))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Keep tests independent of a torchrun/SLURM environment they may be started from.
for _var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "SLURM_PROCID"):
    os.environ.pop(_var, None)


@pytest.fixture(autouse=True)
def _wandb_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The single-process run every layout must match, keyed by extra overrides: run once per
    test run, by whichever worker (pytest-xdist) needs it first; the others read its records
    from the run's shared folder (under a file lock, so no run is made twice)."""
    import hashlib
    import json

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # (each worker's basetemp is in the run's one)
        shared = shared.parent
    cache = {}

    def get(*extra):
        if extra not in cache:
            key = hashlib.sha1(json.dumps(extra).encode()).hexdigest()[:16]
            path = shared / "references" / f"{key}.json"
            path.parent.mkdir(exist_ok=True)
            with FileLock(str(path) + ".lock"):
                if path.exists():
                    records = json.loads(path.read_text())["records"]
                else:
                    records = train(["parallelism=none", *extra],
                                    tmp_path_factory.mktemp("reference"))
                    path.write_text(json.dumps({"extra": list(extra), "records": records}))
            cache[extra] = records
        return cache[extra]

    return get


@pytest.fixture(autouse=True)
def _no_gpus(request, monkeypatch):
    """Tests describe a CPU machine: config resolution sees no GPU (whatever this machine has)
    unless a test passes its own probe (tests/config/test_gpu_defaults.py). Tests marked `gpu`
    see the machine as it is."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr("automodel.config.launch_env.gpu_device_probe", lambda: 0)


def gpus_here() -> tuple[int, str]:
    """(NVIDIA GPUs a test marked `gpu` can use here, why none when 0), read without starting
    CUDA in this process: the device files and CUDA_VISIBLE_DEVICES, and torch's build."""
    import torch

    from automodel.config.launch_env import nvidia_device_files, visible_gpu_count

    if torch.version.cuda is None:
        return 0, f"torch {torch.__version__} is not a CUDA build"
    n = visible_gpu_count(os.environ, nvidia_device_files)
    return n, "" if n else "no NVIDIA GPU is visible (/dev/nvidia<N>, CUDA_VISIBLE_DEVICES)"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (`gpu(n)`: n GPUs) run where the GPUs are; elsewhere they are skipped,
    and the summary (-ra) says why."""
    marked = [(item, item.get_closest_marker("gpu")) for item in items]
    marked = [(item, m) for item, m in marked if m is not None]
    if not marked:
        return
    have, why = gpus_here()
    for item, marker in marked:
        need = marker.args[0] if marker.args else 1
        if have < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} NVIDIA GPU(s) and a CUDA build of torch: "
                       + (why or f"{have} visible")))


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, the test modules) is frozen out of the
    garbage collector's walks for the rest of the run (``automodel/startup.py`` does the same
    for a job's start-up)."""
    import gc

    gc.freeze()
