"""What this machine can run. Checked right after validation, before any process starts."""

from __future__ import annotations

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig


def check_runtime_support(cfg: TrainConfig) -> None:
    """Refuse, with the reason and the fix, a run this machine cannot do: the installed
    torch/transformers must have every internal automodel patches or reads
    (``automodel.compat``)."""
    if cfg.strategy.refusal is not None:  # (megatron_fsdp: CUDA and its package only;
        why = cfg.strategy.hook("refusal")(cfg)  # checked before torch is imported)
        if why is not None:
            raise ConfigError(why)
    from automodel.compat import check_compat

    check_compat()
