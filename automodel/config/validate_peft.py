"""Validation of the ``peft`` group (torch-free: values and the layouts that take adapters).

What needs the model (patterns that match no module, a rank wider than a layer, the LM head)
is checked before launch on the meta model (``automodel/peft/targets.py``)."""

from __future__ import annotations

import dataclasses

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.config.enums import PeftMethod
from automodel.config.validate import check_dtype

ALL_LINEAR = "all-linear"


def check_peft(peft: s.PeftConfig, strategy) -> s.PeftConfig:
    """``peft`` checked against its values and ``strategy`` (the chosen
    ``config.strategies.Strategy``: its ``adapters_refusal``); returns a copy with the target
    patterns as lists."""
    if peft.method == PeftMethod.none:
        _nothing_set_without_a_method(peft)
        return peft
    if peft.rank < 1:
        raise ConfigError(f"peft.rank={peft.rank}: the adapters' width must be at least 1 "
                          "(8 to 64 are usual)")
    if not peft.alpha > 0:
        raise ConfigError(f"peft.alpha={peft.alpha}: must be positive (the update is scaled "
                          "by alpha / rank; alpha = 2 x rank is usual)")
    if not 0.0 <= peft.dropout < 1.0:
        raise ConfigError(f"peft.dropout={peft.dropout}: a probability in [0, 1)")
    check_dtype("peft.lora_dtype", peft.lora_dtype, allow_none=False)
    targets = list(peft.target_modules) if peft.target_modules is not None else None
    if targets is not None:
        if not targets:
            raise ConfigError("peft.target_modules=[]: name at least one pattern (*.q_proj), "
                              f"or [{ALL_LINEAR}], or null for the attention and MLP "
                              "projections")
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ConfigError(f"peft.target_modules={targets}: {ALL_LINEAR} stands alone "
                              "(it already takes every linear layer but the LM head)")
    if strategy.adapters_refusal is not None:
        raise ConfigError(f"peft=lora with parallelism={strategy.name}: "
                          f"{strategy.adapters_refusal}")
    return dataclasses.replace(peft, target_modules=targets,
                               exclude_modules=list(peft.exclude_modules))


def _nothing_set_without_a_method(peft: s.PeftConfig) -> None:
    default = s.PeftConfig()
    changed = [f.name for f in dataclasses.fields(s.PeftConfig)
               if f.name != "method" and getattr(peft, f.name) != getattr(default, f.name)]
    if changed:
        raise ConfigError(f"peft.{changed[0]} is set but no adapters are chosen (peft=none): "
                          "add peft=lora")
