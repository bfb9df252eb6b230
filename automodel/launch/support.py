"""What the runtime can run today. Checked right after validation, before any process starts."""

from __future__ import annotations

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig
from automodel.distributed.megatron_fsdp import UNSUPPORTED_REASON

_NOT_YET = {
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
                              f"mesh.{name}=1")
