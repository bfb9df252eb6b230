"""Checks of single values that every config validator shares (no torch): counts, minutes,
dtype names and byte sizes, each refused with the key, the value and what is allowed."""

from __future__ import annotations

import re

from automodel.config.build import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def shard_bytes(size) -> int:
    """``"5GB"``, ``"500MiB"`` or a number of bytes, as bytes (``save_pretrained``'s
    ``max_shard_size`` spelling: GB = 10^9, GiB = 2^30)."""
    if isinstance(size, int) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(size).lower())
    if m is None or not float(m.group(1)) > 0:
        raise ValueError(f"{size!r} is not a size: write e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def positive(path: str, value, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"{path}={value}: must be >= {minimum}")


def above_zero(path: str, value) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{path}={value}: must be > 0 (minutes; 0.5 is 30 seconds)")


def check_dtype(path: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value not in DTYPE_NAMES:
        raise ConfigError(f"{path}={value!r}: not a dtype name; allowed: {', '.join(DTYPE_NAMES)}"
                          + (" or null" if allow_none else ""))
