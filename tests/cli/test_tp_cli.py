"""Tensor-parallel validation through the command line: exit 2 before any rank starts
(rules on names and numbers before torch is even imported)."""

import pytest

from tests.cli.test_cli import no_torch_env, run

# fast: each command ends before torch is imported, so no rank or process group starts
pytestmark = pytest.mark.fast


@pytest.mark.parametrize("args,expected", [
    (["mesh.tp_size=2", "parallelism.sequence_parallel=true", "trainer.seq_len=63"],
     "trainer.seq_len=63"),
    (["mesh.tp_size=2", "parallelism.tp_plan={lm_head:rowwize}"], "style 'rowwize'"),
    (["mesh.tp_size=2", "parallelism.tp_plan=plan"], "import path"),
    (["parallelism=ddp", "mesh.tp_size=2"], "parallelism=ddp only replicates data"),
    (["mesh.tp_size=2", "distributed.nproc_per_node=3"], "not divisible"),
])
def test_tp_rule_fails_early(args, expected, tmp_path):
    out = run(["parallelism=fsdp2"] + args if "parallelism=ddp" not in args else args, tmp_path,
              no_torch_env(tmp_path))
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr

