"""FSDP2 policies given in YAML with ``_target_``, validated without importing torch.

The typed config keeps a ``PolicySpec`` (class name + checked keyword arguments, dtypes as
names); ``automodel/distributed/fsdp2.py`` turns it into the torch object on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from automodel.config.build import ConfigError

_DTYPES = ("float32", "bfloat16", "float16", "float64")
_MODULES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
            "torch.distributed._composable.fsdp")
# class name -> {keyword: kind}; kind "dtype" takes a dtype name or null, "bool" a bool.
POLICY_FIELDS = {
    "MixedPrecisionPolicy": {"param_dtype": "dtype", "reduce_dtype": "dtype",
                             "output_dtype": "dtype", "cast_forward_inputs": "bool"},
    "CPUOffloadPolicy": {"pin_memory": "bool"},
    "OffloadPolicy": {},
}
_ALLOWED = {"parallelism.mp_policy": ("MixedPrecisionPolicy",),
            "parallelism.offload_policy": ("CPUOffloadPolicy", "OffloadPolicy")}
# options.md: a null mp_policy means bf16 compute with fp32 gradient reduction, and the
# dtypes of module inputs and outputs kept (torch's own default casts floating inputs to the
# parameter dtype at every unit; the reference's default does not).
DEFAULT_MP_POLICY = {"param_dtype": "bfloat16", "reduce_dtype": "float32",
                     "output_dtype": None, "cast_forward_inputs": False}


@dataclass
class PolicySpec:
    name: str  # a key of POLICY_FIELDS
    kwargs: Dict[str, Any] = field(default_factory=dict)


def resolve_policy(path: str, value) -> Optional[PolicySpec]:
    allowed = _ALLOWED[path]
    if value is None:
        if path == "parallelism.mp_policy":
            return PolicySpec("MixedPrecisionPolicy", dict(DEFAULT_MP_POLICY))
        return None
    if not isinstance(value, dict) or "_target_" not in value:
        raise ConfigError(f"{path}={value!r}: expected null or a mapping with _target_: "
                          f"{_MODULES[0]}.{allowed[0]}")
    target = value["_target_"]
    module, _, name = str(target).rpartition(".")
    if module not in _MODULES or name not in allowed:
        raise ConfigError(f"{path}._target_={target!r}: allowed: "
                          + ", ".join(f"{_MODULES[0]}.{a}" for a in allowed))
    kwargs = {k: v for k, v in value.items() if k != "_target_"}
    fields = POLICY_FIELDS[name]
    for key, v in kwargs.items():
        if key not in fields:
            raise ConfigError(f"{path}.{key}: not an argument of {name}; allowed: "
                              f"{', '.join(fields) or 'none'}")
        if fields[key] == "dtype" and v is not None and v not in _DTYPES:
            raise ConfigError(f"{path}.{key}={v!r}: allowed: {', '.join(_DTYPES)} or null")
        if fields[key] == "bool" and not isinstance(v, bool):
            raise ConfigError(f"{path}.{key}={v!r}: expected true or false")
    return PolicySpec(name, kwargs)
