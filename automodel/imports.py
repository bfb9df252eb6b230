"""The one loader of ``pkg.module.NAME`` import paths named in options."""

from __future__ import annotations

import importlib


def load_object(path: str, option: str):
    """The object ``path`` names; a ``ValueError`` naming ``option`` when it cannot be
    imported."""
    module, _, name = str(path).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{option}={path!r}: cannot import it ({err})") from None
