"""Check ``section.key=value`` command-line overrides before Hydra composes.

Hydra rejects unknown keys and values outside an enum too, but only names the schema or the
values; these checks add what is allowed and the closest match. Torch-free and fast.
Overrides they cannot judge are left to Hydra.
"""

from __future__ import annotations

import dataclasses
import typing

from automodel.config.build import check_keys, is_choice
from automodel.config.store import SCHEMAS
from automodel.data.registry import DATA_SOURCES

# option files whose schema is not named like the file
_ALIASES = {("parallelism", "hsdp"): "fsdp2"}
_DEFAULT_CHOICE = {"parallelism": "fsdp2", "data": "corpus"}
_SINGLE_SCHEMA = {"mesh", "distributed", "trainer", "model", "optim"}
_VALUE_FLAGS = {"--cfg", "-c", "--config-name", "-cn", "--config-path", "-cp", "--config-dir",
                "-cd", "--package", "-p", "--info", "-i", "--experimental-rerun"}


def _overrides(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _VALUE_FLAGS:
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception:  # malformed: Hydra reports it with its own message
        return None


def _chosen(parsed) -> dict:
    choices = dict(_DEFAULT_CHOICE)
    for o in parsed:
        if o.key_or_group in ("parallelism", "data", "pipeline"):
            choices[o.key_or_group] = o.value() if not o.is_sweep_override() else None
    return choices


def _section_schema(section: str, choices: dict):
    """The schema class of ``section`` under these group choices (None: not known here)."""
    if section in _SINGLE_SCHEMA:
        return next(iter(SCHEMAS[section].values()))
    if section == "data" and isinstance(choices.get(section), str):
        source = DATA_SOURCES.find(choices[section])
        return source.schema if source is not None else None
    if section == "parallelism" and isinstance(choices.get(section), str):
        name = _ALIASES.get((section, choices[section]), choices[section])
        return SCHEMAS[section].get(name)
    if section == "pipeline" and isinstance(choices.get("pipeline"), str) \
            and choices["pipeline"] != "none":
        return SCHEMAS["pipeline"]["pipeline"]
    return None


def check_cli_overrides(argv: list[str]) -> None:
    """Raise ``ConfigError`` for an override naming a key its section does not have, or giving
    an option with a closed set of values one outside it."""
    parsed = _parse(_overrides(argv))
    if parsed is None:
        return
    choices = _chosen(parsed)
    for o in parsed:
        parts = o.key_or_group.split(".")
        if o.is_add() or o.is_force_add() or o.is_delete() or len(parts) < 2:
            continue
        cls = _section_schema(parts[0], choices)
        if cls is not None:
            check_keys(parts[0], [parts[1]], cls)
    _check_choices(parsed, choices)


def check_choice_overrides(overrides: list[str]) -> None:
    """Raise ``ConfigError`` (key, value, allowed values, the closest one) for an override that
    gives an option of a closed set (``config/enums.py``) a value outside it. Hydra would
    refuse it too, but with its own exception and no suggestion; ``api.compose`` and the CLI
    both run this first, so the message is the same on both paths."""
    parsed = _parse(list(overrides))
    if parsed is not None:
        _check_choices(parsed, _chosen(parsed))


def _check_choices(parsed, choices: dict) -> None:
    for o in parsed:
        parts = o.key_or_group.split(".")
        if o.is_delete() or o.is_sweep_override() or len(parts) < 2:
            continue
        value = o.value()
        if isinstance(value, str) and "${" in value:  # an interpolation: Hydra resolves it
            continue
        tp, optional = _field_type(_choice_schema(parts[0], choices), parts[1:])
        if is_choice(tp):
            tp.parse(o.key_or_group, value, optional=optional)


def _choice_schema(section: str, choices: dict):
    if section in ("logger", "checkpoint"):
        return next(iter(SCHEMAS[section].values()))
    return _section_schema(section, choices)


def _field_type(cls, keys: list[str]):
    """The type of the field ``keys`` names under dataclass ``cls`` (Optional unwrapped), and
    whether it is Optional; (None, False) when there is no such field."""
    tp, optional = cls, False
    for key in keys:
        if not dataclasses.is_dataclass(tp):
            return None, False
        tp = typing.get_type_hints(tp).get(key)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = typing.get_origin(tp) is typing.Union and len(args) == 1
        tp = args[0] if optional else tp
    return tp, optional
