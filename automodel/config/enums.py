"""The closed sets of option values, as enums (no torch).

Each is a ``Choice``: a ``str`` enum whose members are named as the values users write, so
Hydra's structured configs check them at composition (``trainer.loss=fused``), the resolved
config holds a member, and a member still equals its string (``loss == "fused"``) and prints
as it (``f"{loss}"`` is ``fused``). ``Choice.parse`` is the one conversion at the boundary
(plain mappings, command-line overrides): an unknown value is a ``ConfigError`` naming the
key, the value, the allowed values and the closest one.

``ACMode`` is not a schema type: ``parallelism.activation_checkpointing`` also takes the
booleans users have always written (false: none, true: full), which Hydra's enum fields do not
accept, so the field stays untyped in the schema and ``ACMode.parse`` converts it.
"""

from __future__ import annotations

import difflib
import enum

from automodel.config.build import ConfigError

# The layer groups a model's blocks fall into (models/parts.py assigns them): the scopes of
# activation checkpointing and the groups model.freeze takes.
LAYER_GROUPS = ("language", "vision", "audio", "multimodal")
# parallelism.zero_dp_strategy of megatron_fsdp: the number or the library's name
MEGATRON_ZERO_STRATEGIES = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


class Choice(str, enum.Enum):
    """A closed set of string values; members are named as their values."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple:
        return tuple(m.value for m in cls)

    @classmethod
    def allowed(cls, optional: bool = False) -> str:
        """``a, b, c`` (``or null`` when the option may be null)."""
        text = ", ".join(cls.values())
        return f"{text}, or null" if optional else text

    @classmethod
    def parse(cls, key: str, value, optional: bool = False, note: str = ""):
        """``value`` (a member, or its string) as a member; ``None`` stays ``None`` when the
        option is ``optional``. Anything else is a ``ConfigError``: key, value, allowed values,
        did-you-mean, and ``note`` (what the values mean)."""
        if isinstance(value, cls):
            return value
        if value is None and optional:
            return None
        if isinstance(value, str) and value in cls.values():
            return cls(value)
        note = note or NOTES.get(cls.__name__, "")
        raise ConfigError(f"{key}={value!r}: allowed: {cls.allowed(optional)}{note}"
                          f"{did_you_mean(value, cls.values())}")


def did_you_mean(value, allowed) -> str:
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    return f". Did you mean {close[0]!r}?" if close else ""


class Loss(Choice):
    """``trainer.loss``: fused (the LM head and the loss together, chunked), plain, auto."""

    auto = "auto"
    fused = "fused"
    plain = "plain"


# ``raise`` is a keyword: the members are made by name.
OnNonfinite = Choice("OnNonfinite", {"raise": "raise", "skip": "skip"})
OnNonfinite.__doc__ = "``trainer.on_nonfinite``: a NaN/inf loss or gradient norm stops the run " \
                      "(raise) or skips the step (skip)."


class FrozenSharding(Choice):
    """``parallelism.multimodal.frozen_sharding``: how FSDP2 holds frozen towers."""

    root = "root"
    per_layer = "per_layer"
    replicate = "replicate"


class VisionUnit(Choice):
    """``parallelism.multimodal.vision.unit``: each tower block its own FSDP2 unit, or the
    whole tower one unit."""

    layer = "layer"
    tower = "tower"


class VisionTP(Choice):
    """``parallelism.multimodal.vision.tp``: under tensor parallelism, the tower whole on
    every TP rank, or its attention heads and MLP split (``models/vision_tp.py``)."""

    whole = "whole"
    heads = "heads"


class AsyncMode(Choice):
    """``checkpoint.async_mode``: a save blocks training until written (none), or only while
    the state is copied to host memory, the write going on in a thread or a process of each
    rank (``checkpoint/background.py``)."""

    none = "none"
    thread = "thread"
    process = "process"


class WandbMode(Choice):
    """``logger.wandb.mode`` (null: W&B's WANDB_MODE, else online)."""

    online = "online"
    offline = "offline"
    disabled = "disabled"


class PeftMethod(Choice):
    """``peft.method`` (the ``peft`` group's files): no adapters, LoRA adapters beside the
    frozen base weights, or QLoRA (LoRA over base weights stored in 4-bit NF4)."""

    none = "none"
    lora = "lora"
    qlora = "qlora"


class LoraInit(Choice):
    """``peft.init_lora_weights``: how A starts (B starts at zero, so the adapted model starts
    as the base): kaiming (uniform, as ``nn.Linear`` draws its weights) or gaussian
    (normal with standard deviation 1/rank)."""

    kaiming = "kaiming"
    gaussian = "gaussian"


class ACMode(Choice):
    """Activation checkpointing: none, full (whole blocks), selective (what torch's policy
    picks inside each block)."""

    none = "none"
    full = "full"
    selective = "selective"

    @classmethod
    def parse(cls, key: str, value, optional: bool = False, note: str = ""):
        """Also the booleans: false (or null) is none, true is full."""
        if isinstance(value, cls):
            return value
        if value is False or value is None:
            return cls.none
        if value is True:
            return cls.full
        if isinstance(value, str) and value in ("full", "selective"):
            return cls(value)
        raise ConfigError(f"{key}={value!r}: allowed: false, true, 'full', 'selective'"
                          f"{did_you_mean(value, ('full', 'selective', 'false', 'true'))}")


# What the values mean, after the allowed values in a refusal.
NOTES = {
    "Loss": " (auto: the LM head fused with the loss where that is exact)",
    "VisionUnit": " (each tower block its own FSDP2 unit, or the whole tower one unit)",
    "VisionTP": " (the tower whole on every TP rank, or split by attention heads)",
    "WandbMode": " (W&B's WANDB_MODE, else online)",
    "PeftMethod": " (the peft group: peft=none, peft=lora or peft=qlora)",
    "LoraInit": " (A's initialization; B starts at zero)",
}
