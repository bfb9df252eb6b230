"""What this machine can run. Checked right after validation, before any process starts."""

from __future__ import annotations

from automodel.config.build import ConfigError
from automodel.config.launch_env import cuda_device_index
from automodel.config.resolve import TrainConfig

SETUP_CUDA = "AUTOMODEL_TORCH=cuda bash scripts/setup.sh"


def check_runtime_support(cfg: TrainConfig) -> None:
    """Refuse, with the reason and the fix, a run this machine cannot do: the installed
    torch/transformers must have every internal automodel patches or reads
    (``automodel.compat``); GPUs must be used when they are there (``check_gpu_use``)."""
    if cfg.strategy.refusal is not None:  # (megatron_fsdp: CUDA and its package only;
        why = cfg.strategy.hook("refusal")(cfg)  # checked before torch is imported)
        if why is not None:
            raise ConfigError(why)
    check_gpu_use(cfg)
    check_pinned_memory(cfg)
    from automodel.compat import check_compat

    check_compat()


def torch_build() -> tuple[str, bool]:
    """(torch's version, whether it is a CUDA build). Reads the build, never starts CUDA."""
    import torch

    return torch.__version__, torch.version.cuda is not None


def check_gpu_use(cfg: TrainConfig) -> None:
    """No silent CPU run on GPUs: where the job's ranks have NVIDIA GPUs (visible here, or
    given by SLURM; at submit time, the job's request) and the backend is left to automodel
    (``distributed.backend`` null) or is nccl, torch must be a CUDA build. Then each rank must
    find its own GPU (``cuda_device_index``). ``distributed.backend=gloo`` runs on the CPU on
    purpose and passes."""
    launch, backend = cfg.launch, cfg.distributed.backend
    gpus = max(launch.gpus or 0, launch.gpus_allocated)
    if gpus == 0 or backend not in (None, "nccl"):
        return
    version, cuda = torch_build()
    if not cuda:
        given = (f"{launch.gpus} visible" if launch.gpus else
                 f"{launch.gpus_allocated} given by SLURM (SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS)")
        raise ConfigError(
            f"the job's ranks have NVIDIA GPUs ({given}) but the installed torch {version} is "
            "a CPU build: the job would train on the CPU over gloo. Install the CUDA build "
            f"with `{SETUP_CUDA}` (setup.sh picks the CPU build on a machine without a GPU, "
            "such as a login node), or set distributed.backend=gloo to train on the CPU on "
            "purpose")
    if launch.external and launch.gpus:
        try:
            cuda_device_index(launch.gpus, launch.local_rank, launch.local_world_size or 1)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def check_pinned_memory(cfg: TrainConfig) -> None:
    """``checkpoint.pinned_memory`` speeds the copy of a save from GPUs: refused where the
    ranks train on the CPU (no GPU, or ``distributed.backend=gloo``)."""
    launch = cfg.launch
    gpus = max(launch.gpus or 0, launch.gpus_allocated)
    if cfg.checkpoint.pinned_memory and (gpus == 0 or cfg.distributed.backend == "gloo"):
        where = ("distributed.backend=gloo" if gpus else "the job's ranks have no GPU")
        raise ConfigError("checkpoint.pinned_memory=true pins the host memory an async save "
                          f"copies GPU tensors into, but the ranks train on the CPU ({where}); "
                          "drop checkpoint.pinned_memory")
