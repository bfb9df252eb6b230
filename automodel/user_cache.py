"""Where automodel keeps what it can compute again: ``$AUTOMODEL_CACHE``, else
``~/.cache/automodel`` (token caches in ``tokens/``, the compat check in ``compat/``)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "AUTOMODEL_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "automodel")
