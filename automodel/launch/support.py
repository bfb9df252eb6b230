"""What this machine can run. Checked right after validation, before any process starts."""

from __future__ import annotations

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig
from automodel.distributed.megatron_fsdp import refusal


def check_runtime_support(cfg: TrainConfig) -> None:
    """Refuse, with the reason and the fix, a run this machine cannot do."""
    if cfg.strategy == "megatron_fsdp":
        why = refusal(cfg.launch.gpus, cfg.distributed.backend)
        if why is not None:
            raise ConfigError(why)
