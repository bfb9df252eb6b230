"""``automodel/config`` sits below the runtime: it imports nothing of the packages that run a
job, and checking a configuration imports no torch.distributed.checkpoint."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "automodel" / "config"
FORBIDDEN = ("automodel.distributed", "automodel.models", "automodel.launch",
             "automodel.recipes", "automodel.checkpoint")


def _imported(tree: ast.AST):
    """(line, module) of every import in ``tree``, top level or inside a function; ``from
    automodel import launch`` counts as ``automodel.launch``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def test_config_imports_no_runtime_package():
    files = sorted(CONFIG.glob("*.py"))
    assert len(files) > 5
    found = [f"{path.relative_to(ROOT)}:{line}: {module}"
             for path in files for line, module in _imported(ast.parse(path.read_text()))
             if _forbidden(module)]
    assert not found, "config/ imports runtime packages:\n" + "\n".join(found)


def test_the_scan_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from automodel.launch.env import x\n"
                     "def g():\n    import automodel.models.parts\n"
                     "from automodel import checkpoint\n")
    assert {m for _, m in _imported(tree) if _forbidden(m)} >= {
        "automodel.launch.env", "automodel.models.parts", "automodel.checkpoint"}


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
