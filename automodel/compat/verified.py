"""The compat check remembered per installation, so that a process which has not imported torch
yet does not import all of it only to check it.

``check_entries`` imports every module an entry names: in a launcher, a submitter or the
parent of local ranks (which never train, and import torch only for torchrun's agent, or not
at all) that is about 4 s of CPU per start (torch's dynamo, transformers' masks, DTensor, the
pipelining schedules). A check that passed is written down under a key that names the
installation it passed on, and a later start on the same installation finds it and skips the
imports:

- the Python interpreter (``sys.executable``, ``sys.version``);
- for torch and transformers: the installed version, the dist-info's ``RECORD`` (the list of
  every installed file with its hash: any reinstall changes it) and the size and modification
  time of the package's ``__init__.py``;
- the source of ``automodel/compat`` itself (the entries and their checks).

A failed check is never remembered. The entries of modules this process has imported already
(a rank that has built its model, a test) are checked in full each time (milliseconds), so an
internal changed at run time is still seen. The folder is ``$AUTOMODEL_CACHE/compat`` (else
``~/.cache/automodel/compat``); ``AUTOMODEL_COMPAT_CACHE=0`` turns the memory off. A folder that
cannot be written only costs the imports again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from importlib import metadata
from pathlib import Path

from automodel.user_cache import cache_root

log = logging.getLogger(__name__)

LIBRARIES = ("torch", "transformers")
OFF_ENV = "AUTOMODEL_COMPAT_CACHE"  # "0": always check in full
_SOURCE = Path(__file__).resolve().parent


def _library_identity(name: str) -> list[str] | None:
    """What identifies an installed library's files, or None (not installed: no memory)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    record = dist.read_text("RECORD") or ""
    parts = [name, dist.version, hashlib.sha256(record.encode()).hexdigest()]
    init = Path(str(dist.locate_file(f"{name}/__init__.py")))
    try:
        st = init.stat()
    except OSError:
        return None
    return parts + [str(init), str(st.st_size), str(st.st_mtime_ns)]


def installation_key(entries_name: str) -> str | None:
    """The key of this installation for the entry list ``entries_name``, or None when it
    cannot be told (a library not installed from a distribution)."""
    digest = hashlib.sha256()
    for part in (entries_name, sys.executable, sys.version):
        digest.update(part.encode() + b"\0")
    for lib in LIBRARIES:
        identity = _library_identity(lib)
        if identity is None:
            return None
        digest.update("\0".join(identity).encode() + b"\0")
    for source in sorted(_SOURCE.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:32]


def _entry_path(key: str) -> Path:
    return cache_root() / "compat" / f"{key}.ok"


def enabled() -> bool:
    return os.environ.get(OFF_ENV, "1") != "0"


def passed_before(key: str | None) -> bool:
    return key is not None and enabled() and _entry_path(key).is_file()


def remember_pass(key: str | None) -> None:
    """Write down that the check passed on this installation (atomically; errors ignored)."""
    if key is None or not enabled():
        return
    path = _entry_path(key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(" ".join(f"{lib} {metadata.version(lib)}" for lib in LIBRARIES) + "\n")
        os.replace(tmp, path)
    except OSError as err:  # (read-only home, full disk: the next start checks in full)
        log.debug("could not remember the compat check in %s: %s", path, err)
        tmp.unlink(missing_ok=True)
