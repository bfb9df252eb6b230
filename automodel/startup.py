"""Start-up without the garbage collector.

Importing torch and transformers creates about a million objects, nearly all of them kept for
the life of the process. The cyclic collector runs every few hundred allocations and, as the
heap grows, walks all of it again: measured on a 2-core machine, importing what a rank needs
costs 4.4-4.7 s of CPU with the collector on and 3.4 s with it off. ``without_collections``
turns it off for a process's start-up (config, preflight, the imports of the job's code), then
freezes what exists (``gc.freeze``: later collections skip it, as in a rank forked from the
fork server, ``runtime/preloaded.py``) and turns it back on. Reference counting frees garbage as
usual meanwhile; only cycles made during start-up wait, and are kept.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def without_collections():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
