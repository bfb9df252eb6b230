"""Tensor-parallel validation through the command line: exit 2 before torch is imported."""

import pytest

from tests.cli.test_cli import no_torch_env, run


@pytest.mark.parametrize("args,expected", [
    (["mesh.tp_size=4"], "must divide the model's num_key_value_heads=2"),
    (["mesh.tp_size=8"], "must divide the model's num_attention_heads=4"),
    (["mesh.tp_size=2", "model.config.vocab_size=257"], "vocab_size=257"),
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
