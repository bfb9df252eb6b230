"""What a compat entry is, and the start-up check of every entry (importable without torch)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

from automodel.errors import ConfigError

# The versions the internals below were read from and the suite runs on, and the ranges
# pyproject.toml pins (tests/test_compat.py keeps the ranges equal to pyproject's).
TESTED_WITH = {"torch": "2.13.0", "transformers": "5.24.0", "torchao": "0.18.0"}
PINNED = {"torch": ">=2.13,<2.15", "transformers": ">=5.0,<6", "torchao": ">=0.18,<0.19"}


class CompatError(ConfigError):
    """The installed torch or transformers lacks an internal automodel relies on, or changed
    its shape. Raised before any process starts."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """One private (or monkeypatched) object of torch or transformers that automodel uses.

    ``module`` + ``attr`` (dotted) name it. ``feature``: what in automodel needs it (an option
    or a technique), named in the error. ``patched``: automodel replaces or writes it (not only
    reads it). Shape, checked at start-up:
    - ``params``: it is callable and its parameters start with these names;
    - ``kind``: it is an instance of this type;
    - ``probe``: the attribute is looked up on ``probe()`` (an instance attribute, such as a
      module's ``_parameters``) instead of on the module;
    - ``assigned_in``: an instance attribute that ``attr``'s class sets in ``__init__``
      (``attr`` is then ``Class.name``; used where no instance can be built before launch);
    - ``check``: a further test of the object, returning what is wrong or None.
    """

    module: str
    attr: str
    feature: str
    patched: bool = True
    params: tuple[str, ...] | None = None
    kind: type | None = None
    probe: Callable[[], Any] | None = None
    assigned_in: bool = False
    check: Callable[[Any], str | None] | None = None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"

    @property
    def library(self) -> str:
        return self.module.split(".", 1)[0]


_MISSING = object()


def _lookup(entry: Internal) -> Any:
    obj = entry.probe() if entry.probe is not None else importlib.import_module(entry.module)
    parts = entry.attr.split(".")
    if entry.assigned_in:
        owner = obj
        for part in parts[:-1]:
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                return _MISSING
        init = getattr(owner, "__init__", None)
        code = getattr(init, "__code__", None)
        return owner if code is not None and parts[-1] in code.co_names else _MISSING
    for part in parts:
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _param_names(obj: Any) -> list[str] | None:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # (a builtin without a signature: callable is all we know)
        return None


def problem(entry: Internal) -> str | None:
    """What is wrong with ``entry`` in the installed libraries, or None."""
    try:
        obj = _lookup(entry)
    except ImportError as err:
        return f"cannot import {entry.module} ({err})"
    if obj is _MISSING:
        return ("not assigned in __init__ any more" if entry.assigned_in
                else "missing")
    if entry.params is not None:
        if not callable(obj):
            return f"not callable (a {type(obj).__name__})"
        names = _param_names(obj)
        if names is not None and names[:len(entry.params)] != list(entry.params):
            return f"parameters ({', '.join(names)}), expected ({', '.join(entry.params)}, ...)"
    if entry.kind is not None and not isinstance(obj, entry.kind):
        return f"a {type(obj).__name__}, expected a {entry.kind.__name__}"
    if entry.check is not None:
        return entry.check(obj)
    return None


def installed_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for lib in TESTED_WITH:
        try:
            found[lib] = version(lib)
        except PackageNotFoundError:
            found[lib] = "not installed"
    return found


def compat_message(failures: list[tuple[Internal, str]]) -> str:
    lines = ["the installed torch/transformers/torchao lack internals automodel relies on:"]
    for entry, what in failures:
        verb = "patches" if entry.patched else "uses"
        lines.append(f"  - {entry.name}: {what}; {verb} it for: {entry.feature}")
    installed = installed_versions()
    lines.append("installed: " + ", ".join(f"{k} {v}" for k, v in installed.items()))
    lines.append("automodel pins " + ", ".join(f"{k}{v}" for k, v in PINNED.items())
                 + " and was tested with " + ", ".join(f"{k} {v}"
                                                       for k, v in TESTED_WITH.items()))
    lines.append("fix: install a tested version (pip install " + " ".join(
        f"{k}=={v}" for k, v in TESTED_WITH.items()) + "), or port the entry in automodel/compat/")
    return "\n".join(lines)


def check_entries(entries: list[Internal]) -> None:
    """Raise ``CompatError`` naming every entry that is missing or has the wrong shape."""
    failures = [(e, p) for e in entries if (p := problem(e)) is not None]
    if failures:
        raise CompatError(compat_message(failures))
