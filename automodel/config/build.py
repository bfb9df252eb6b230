"""Build schema dataclasses from plain mappings, checking keys and types.

Hydra already checks what it can, but ``+key=`` / ``++key=`` overrides and hand-written
configs bypass it, so the boundary checks again. Every message names the full key, the bad
value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import typing
from typing import Any, Mapping

from automodel.errors import ConfigError  # (config's error; imported from here too)


def check_keys(path: str, keys, cls) -> None:
    """Raise ``ConfigError`` for keys that are not fields of ``cls``."""
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in keys if k not in allowed]
    if not unknown:
        return
    lines = []
    for key in unknown:
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" Did you mean '{path}.{close[0]}'?" if close else ""
        lines.append(f"'{path}.{key}' is not an option of {cls.__name__}.{hint}")
    lines.append(f"Allowed keys under '{path}': {', '.join(allowed)}")
    raise ConfigError("\n".join(lines))


def build(cls, data: Mapping[str, Any] | None, path: str):
    """Instantiate dataclass ``cls`` from ``data`` (unknown keys and wrong types rejected)."""
    data = dict(data or {})
    check_keys(path, data.keys(), cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(hints[f.name], data[f.name], f"{path}.{f.name}")
    return cls(**kwargs)


def is_choice(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, enum.Enum) and hasattr(tp, "parse")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(tp, value, path: str):
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        if is_choice(inner[0]):
            return inner[0].parse(path, value, optional=True)
        return _coerce(inner[0], value, path)
    if is_choice(tp):  # a closed set of values (config/enums.py): its own message
        return tp.parse(path, value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}={value!r}: expected a mapping of {tp.__name__} options")
        return build(tp, value, path)
    if origin in (list, typing.List):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={value!r}: expected a list")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, typing.Dict):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}={value!r}: expected a mapping")
        return {k: _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if value is None:
        raise ConfigError(f"{path}=null: a value of type {_type_name(tp)} is required")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise AssertionError(f"schema type {tp} at {path} is not supported by build()")
    raise ConfigError(f"{path}={value!r}: expected {_type_name(tp)}, got {type(value).__name__}")
