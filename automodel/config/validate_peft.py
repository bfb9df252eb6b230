"""Validation of the ``peft`` group (torch-free: values and the layouts that take adapters).

What needs the model (patterns that match no module, a rank wider than a layer, the LM head)
is checked before launch on the meta model (``automodel/peft/targets.py``)."""

from __future__ import annotations

import dataclasses

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.config.enums import PeftMethod
from automodel.config.value_checks import check_dtype

ALL_LINEAR = "all-linear"
NF4_KEYS = ("nf4_block_size", "nf4_scaler_block_size")  # options of peft=qlora only


def check_peft(peft: s.PeftConfig, strategy, layout, compute_dtype: str = "float32"
               ) -> s.PeftConfig:
    """``peft`` checked against its values, ``strategy`` (the chosen
    ``config.strategies.Strategy``: its ``adapters_refusal``) and ``layout`` (QLoRA's NF4
    weights do not split under TP); returns a copy with the target patterns as lists and
    ``base_dtype`` resolved (null: ``compute_dtype``, the dtype the layers compute in)."""
    if peft.method == PeftMethod.none:
        changed = _changed(peft, [f.name for f in dataclasses.fields(peft) if f.name != "method"])
        if changed:
            raise ConfigError(f"peft.{changed[0]} is set but no adapters are chosen "
                              "(peft=none): add peft=lora or peft=qlora")
        return peft
    if peft.method == PeftMethod.qlora:
        _check_nf4(peft, layout)
    elif _changed(peft, NF4_KEYS):
        raise ConfigError(f"peft.{_changed(peft, NF4_KEYS)[0]} is set but peft={peft.method}: "
                          "it applies to peft=qlora")
    if peft.rank < 1:
        raise ConfigError(f"peft.rank={peft.rank}: the adapters' width must be at least 1 "
                          "(8 to 64 are usual)")
    if not peft.alpha > 0:
        raise ConfigError(f"peft.alpha={peft.alpha}: must be positive (the update is scaled "
                          "by alpha / rank; alpha = 2 x rank is usual)")
    if not 0.0 <= peft.dropout < 1.0:
        raise ConfigError(f"peft.dropout={peft.dropout}: a probability in [0, 1)")
    check_dtype("peft.lora_dtype", peft.lora_dtype, allow_none=False)
    check_dtype("peft.base_dtype", peft.base_dtype)
    targets = list(peft.target_modules) if peft.target_modules is not None else None
    if targets is not None:
        if not targets:
            raise ConfigError("peft.target_modules=[]: name at least one pattern (*.q_proj), "
                              f"or [{ALL_LINEAR}], or null for the attention and MLP "
                              "projections")
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ConfigError(f"peft.target_modules={targets}: {ALL_LINEAR} stands alone "
                              "(it already takes every linear layer but the LM head)")
    if peft.experts:
        _check_experts(peft, layout)
    if strategy.adapters_refusal is not None:
        raise ConfigError(f"peft={peft.method} with parallelism={strategy.name}: "
                          f"{strategy.adapters_refusal}")
    return dataclasses.replace(peft, target_modules=targets,
                               exclude_modules=list(peft.exclude_modules),
                               base_dtype=peft.base_dtype or compute_dtype)


def _check_nf4(peft: s.PeftConfig, layout) -> None:
    if peft.nf4_block_size < 2 or peft.nf4_block_size % 2:
        raise ConfigError(f"peft.nf4_block_size={peft.nf4_block_size}: an even number of "
                          "values per NF4 scale (two 4-bit values share a byte); 64 is usual")
    if peft.nf4_scaler_block_size < 1:
        raise ConfigError(f"peft.nf4_scaler_block_size={peft.nf4_scaler_block_size}: at "
                          "least 1 block per quantized scale group; 256 is usual")
    if layout.tp > 1:
        raise ConfigError(f"peft=qlora with mesh.tp_size={layout.tp}: NF4 weights split only "
                          "by whole rows of scale groups (as FSDP2 shards them), and a "
                          "row-wise TP layer splits its weight by columns: set mesh.tp_size=1 "
                          "and shard over data (FSDP2), context or pipeline ranks, or use "
                          "peft=lora under TP")


def _check_experts(peft: s.PeftConfig, layout) -> None:
    """Expert adapters are merged into each expert's weight as the layer runs."""
    if peft.use_dora or peft.dropout:
        which = "peft.use_dora=true" if peft.use_dora else f"peft.dropout={peft.dropout}"
        raise ConfigError(f"peft.experts=true with {which}: an expert's update is merged into "
                          "its weight as the layer runs, where DoRA's row lengths and dropout "
                          "on the adapter's input have no place; leave them at their defaults "
                          "or set peft.experts=false")
    if layout.tp > 1:
        raise ConfigError(f"peft.experts=true with mesh.tp_size={layout.tp}: expert adapters "
                          "are split with their experts over expert-parallel ranks, not by "
                          "features over TP ranks; spread the experts with mesh.ep_size "
                          "instead, or set peft.experts=false")


def _changed(peft: s.PeftConfig, keys) -> list[str]:
    """The options among ``keys`` set to other than their defaults."""
    default = s.PeftConfig()
    return [k for k in keys if getattr(peft, k) != getattr(default, k)]
