"""What the runtime can run today. Checked right after validation, before any process starts."""

from __future__ import annotations

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig
from automodel.distributed.megatron_fsdp import UNSUPPORTED_REASON

_NOT_YET = {
    "cp_size": "context parallelism",
    "ep_size": "expert parallelism",
}


def check_runtime_support(cfg: TrainConfig) -> None:
    """Refuse, with the reason, layouts whose runtime has not landed yet."""
    if cfg.strategy == "megatron_fsdp":
        raise ConfigError(UNSUPPORTED_REASON)
    for name, what in _NOT_YET.items():
        value = getattr(cfg.mesh, name)
        if value > 1:
            raise ConfigError(f"mesh.{name}={value}: the options of {what} are validated, but its "
                              "runtime is not available in this version yet; use "
                              f"mesh.{name}=1 (and pipeline=none)")
    if cfg.pipeline is not None:
        _check_pipeline_support(cfg.pipeline)
    if cfg.launch.kind == "slurm":
        raise ConfigError("this process runs as one of several srun tasks, which is not "
                          "supported yet: start the ranks with torchrun, or run train.py once "
                          "and let it start local ranks (distributed.nproc_per_node)")


# Pipeline options whose runtime has not landed yet, with the value that means "unused".
_PIPELINE_NOT_YET: dict = {}


def _check_pipeline_support(pipeline) -> None:
    for name, unused in _PIPELINE_NOT_YET.items():
        value = getattr(pipeline, name)
        if value != unused:
            raise ConfigError(f"pipeline.{name}={value!r} is validated but not available in "
                              f"this version yet; leave it at {unused!r}")
