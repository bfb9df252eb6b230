"""Check ``section.key=value`` command-line overrides before Hydra composes.

Hydra rejects unknown keys too, but only names the schema; this check adds what is allowed
and the closest match. Torch-free and fast. Overrides it cannot judge are left to Hydra.
"""

from __future__ import annotations

from automodel.config.build import check_keys
from automodel.config.store import SCHEMAS

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


def check_cli_overrides(argv: list[str]) -> None:
    """Raise ``ConfigError`` for an override naming a key its section does not have."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(_overrides(argv))
    except Exception:  # malformed: Hydra reports it with its own message
        return
    choices = dict(_DEFAULT_CHOICE)
    for o in parsed:
        if o.key_or_group in ("parallelism", "data", "pipeline"):
            choices[o.key_or_group] = o.value() if not o.is_sweep_override() else None
    for o in parsed:
        parts = o.key_or_group.split(".")
        if o.is_add() or o.is_force_add() or o.is_delete() or len(parts) < 2:
            continue
        section, key = parts[0], parts[1]
        if section in _SINGLE_SCHEMA:
            cls = next(iter(SCHEMAS[section].values()))
        elif section in ("parallelism", "data") and isinstance(choices.get(section), str):
            name = _ALIASES.get((section, choices[section]), choices[section])
            cls = SCHEMAS[section].get(name)
        elif section == "pipeline" and isinstance(choices.get("pipeline"), str) \
                and choices["pipeline"] != "none":
            cls = SCHEMAS["pipeline"]["pipeline"]
        else:
            continue
        if cls is not None:
            check_keys(section, [key], cls)
