"""What the runtime can run today. Checked right after validation, before any process starts."""

from __future__ import annotations

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig
from automodel.distributed.megatron_fsdp import UNSUPPORTED_REASON


def check_runtime_support(cfg: TrainConfig) -> None:
    """Refuse, with the reason, layouts whose runtime has not landed yet."""
    if cfg.strategy == "megatron_fsdp":
        raise ConfigError(UNSUPPORTED_REASON)
