"""automodel.startup: a process's start-up runs without the cyclic garbage collector, and what
it imported is frozen out of later collections."""

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from automodel.startup import without_collections

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.fast
def test_no_collection_inside_and_everything_frozen_after():
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        before = gc.get_freeze_count()
        with without_collections():
            assert not gc.isenabled()
            kept = [[] for _ in range(50_000)]  # (enough allocations for several collections)
            for item in kept:
                item.append(item)  # cycles
        assert gc.isenabled() and collections == []
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()


def test_a_job_starts_without_collections_until_its_rank_code_is_imported(tmp_path):
    """A one-process job: no collection runs from its preflight (torch's and transformers'
    imports) to its training code's import (counted by a callback the job's own process
    installs before Hydra starts; with the collector on, about a hundred run there)."""
    probe = (
        "import gc, sys, runpy\n"
        "seen = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and seen.append("
        "'automodel.checks.preflight' in sys.modules and "
        "'automodel.recipes.train' not in sys.modules))\n"
        f"sys.argv = ['train.py', 'parallelism=none', 'data=synthetic', 'trainer.max_steps=1',"
        f" 'distributed.backend=gloo', 'hydra.run.dir={tmp_path}']\n"
        f"runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')\n")
    probe = probe.replace("runpy.run_path", "import atexit; atexit.register(lambda: print("
                          "'COLLECTIONS_BEFORE_RANK_CODE', seen.count(True)));\nrunpy.run_path")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("COLLECTIONS_BEFORE_RANK_CODE")]
    assert line and int(line[0].split()[1]) == 0, out.stdout[-2000:]
