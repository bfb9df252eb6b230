"""Registries: the one home of a family's names (the data sources; the strategies take the
same shape).

An entry is an object with a ``name`` (the option file's name, ``data=<name>``) and a
``schema`` (the dataclass its option file is built from). A registry holds each name once and
each schema once, so the resolver can find the entry of a composed config by its schema and
the runtime can find it by its name. An unknown name or schema is a ``ConfigError`` naming the
key, the value, the allowed names and the closest one.

Torch-free: ``config/`` imports registries. What an entry does at run time it names by import
path (``"pkg.module.function"``), loaded only when it is called (``load_hook``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Callable, Dict, Generic, Iterator, Optional, TypeVar, Union

from automodel.errors import ConfigError

T = TypeVar("T")
Hook = Union[str, Callable]  # an import path "pkg.module.NAME", or the callable itself
NAME = re.compile(r"[a-z][a-z0-9_]*$")


class Registry(Generic[T]):
    """Entries of one kind, by name and by schema."""

    def __init__(self, key: str, kind: str):
        self.key = key  # the config key the names are chosen with ("data")
        self.kind = kind  # what an entry is, in messages ("data source")
        self._by_name: Dict[str, T] = {}

    def register(self, entry: T) -> T:
        """Add ``entry``; a malformed entry, or a taken name or schema, is a ``TypeError`` or
        ``ValueError`` (a programming error, raised where the entry is registered)."""
        name, schema = entry.name, entry.schema
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{self.kind} name {name!r}: lower-case letters, digits and _ "
                             "(it is an option file's name)")
        if not dataclasses.is_dataclass(schema) or not isinstance(schema, type):
            raise TypeError(f"{self.kind} {name!r}: its schema {schema!r} is not a dataclass")
        if name in self._by_name:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        owner = self._owner_of(schema)
        if owner is not None:
            raise ValueError(f"{self.kind} {name!r}: the schema {schema.__name__} is already "
                             f"{owner.name!r}'s; each {self.kind} has a schema of its own")
        self._by_name[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        self._by_name.pop(name)

    def get(self, name: str) -> T:
        """The entry called ``name``; an unknown name is a ``ConfigError``."""
        if name in self._by_name:
            return self._by_name[name]
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{self.key}={name!r}: no such {self.kind}.{hint} Allowed: "
                          f"{', '.join(self.names())}")

    def find(self, name: str) -> Optional[T]:
        return self._by_name.get(name)

    def of_schema(self, schema) -> T:
        """The entry whose schema is ``schema`` (the type of a composed config node)."""
        owner = self._owner_of(schema)
        if owner is not None:
            return owner
        got = getattr(schema, "__name__", schema)
        raise ConfigError(f"'{self.key}' has no {self.kind} schema (got {got}): its option "
                          f"file must name one in its defaults list "
                          f"(- /schema/{self.key}@_here_: NAME), NAME one of: "
                          f"{', '.join(self.names())}")

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._by_name.values()))

    def __contains__(self, name) -> bool:
        return name in self._by_name

    def _owner_of(self, schema) -> Optional[T]:
        return next((e for e in self._by_name.values() if e.schema is schema), None)


def load_hook(hook: Hook, what: str) -> Callable:
    """The callable ``hook`` names (an import path is imported now); ``what`` names the hook in
    the error when it cannot be imported."""
    if callable(hook):
        return hook
    from automodel.imports import load_object

    return load_object(hook, what)
