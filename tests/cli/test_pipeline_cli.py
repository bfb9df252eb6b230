"""Pipeline validation through the command line: exit 2 before torch is imported."""

import pytest

from tests.cli.test_cli import no_torch_env, run
from tests.helpers import write_schedule_csv

# fast: each command ends before torch is imported, so no rank or process group starts
pytestmark = pytest.mark.fast


@pytest.mark.parametrize("args,expected", [
    (["pipeline=1f1b", "pipeline.pp_schedule=zigzag"], "'zigzag' is not a schedule"),
    (["pipeline=interleaved", "mesh.pp_size=4", "distributed.nproc_per_node=4"],
     "needs 8 stages but the model has model.config.num_hidden_layers=4"),
    (["pipeline=interleaved", "pipeline.layers_per_stage=1", "model.config.num_hidden_layers=3"],
     "round_virtual_stages_to_pp_multiple"),
    (["pipeline=1f1b", "pipeline.pp_microbatch_size=3"], "must be divisible by"),
    (["pipeline=1f1b", "pipeline.pp_microbatch_size=16"], "1f1b needs at least"),
    (["pipeline=1f1b", "pipeline.pp_seq_len=32"], "must equal trainer.seq_len=64"),
    (["pipeline=1f1b", "pipeline.module_fqns_per_model_part=[[a],[b],[c]]"], "has 3 parts"),
])
def test_pipeline_rule_fails_early(args, expected, tmp_path):
    out = run(["parallelism=fsdp2"] + args, tmp_path, no_torch_env(tmp_path))
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr


def test_malformed_csv_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0F1\n1F0,oops\n")
    out = run(["parallelism=fsdp2", "pipeline=csv", f"pipeline.pp_schedule_csv={bad}"],
              tmp_path, no_torch_env(tmp_path))
    assert out.returncode == 2 and "row 2, column 2: 'oops'" in out.stderr


def test_csv_rows_must_match_pp_size(tmp_path):
    path = write_schedule_csv(tmp_path / "s.csv", pp=4, n_microbatches=16)
    out = run(["parallelism=fsdp2", "pipeline=csv", f"pipeline.pp_schedule_csv={path}"],
              tmp_path)
    assert out.returncode == 2 and "has 4 rows but mesh.pp_size=2" in out.stderr
