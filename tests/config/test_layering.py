"""``automodel/config`` sits below the runtime: it imports nothing of the packages that run a
job, and checking a configuration imports no torch.distributed.checkpoint."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_import_layers import import_graph

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
# (the floors of tests/test_import_layers.py keep config below launching, planning and
# training; within the libraries' floor, config also stays below these)
FORBIDDEN = ("automodel.distributed", "automodel.models", "automodel.launch",
             "automodel.recipes", "automodel.checkpoint")


def test_config_imports_no_runtime_package():
    graph = import_graph(ROOT)
    config = [m for m in graph if m.startswith("automodel.config.")]
    assert len(config) > 5
    found = [f"{m}:{line}: {t}" for m in sorted(config) for t, line in graph[m].items()
             if any(t == f or t.startswith(f + ".") for f in FORBIDDEN)]
    assert not found, "config/ imports runtime packages:\n" + "\n".join(found)


CHILD = """
import json, sys
from automodel.api import load_config
out = sys.argv[1]
cfgs = [load_config(["parallelism=ddp", "checkpoint.resume=" + path], output_dir=out, env={})
        for path in (sys.argv[2], "auto")]
assert [c.checkpoint.resume for c in cfgs] == [sys.argv[2], "auto"]
print(json.dumps(sorted(m for m in sys.modules if m.startswith("torch.distributed"))))
"""


def test_validating_a_resume_imports_no_checkpoint_reader(tmp_path):
    """An explicit checkpoint path and ``auto`` (which finds a complete checkpoint under the
    output directory): resolving either reads no checkpoint metadata, so needs no torch."""
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text("{}")
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(ckpt)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "torch.distributed.checkpoint" not in loaded, loaded
