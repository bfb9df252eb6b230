"""Pipeline parallelism: every schedule matches a single process (fp32, rtol 1e-5)."""

import pytest

from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, train, write_schedule_csv

PP = ["parallelism=fsdp2", FP32, "pipeline.pp_microbatch_size=2"]  # 4 micro-batches


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "looped_bfs", "dfs",
                                      "zero_bubble", "v_schedule"])
def test_schedule_matches_single_process(schedule, reference, tmp_path):
    # Two ranks; multi-stage schedules place two stages on each (one layer per stage).
    assert_matches(train(PP + [f"pipeline={schedule}"], tmp_path), reference())


@pytest.mark.parametrize("name,overrides", [
    ("scale_grads_in_schedule", ["pipeline=interleaved", "pipeline.scale_grads_in_schedule=true"]),
    ("two_schedule_steps_per_optimizer_step", ["pipeline=gpipe", "pipeline.pp_batch_size=4"]),
    ("torch_schedule_name", ["pipeline=1f1b", "pipeline.pp_schedule=Interleaved1F1B"]),
])
def test_pipeline_options_keep_parity(name, overrides, reference, tmp_path):
    assert_matches(train(PP + overrides, tmp_path), reference())


def test_pp2_times_fsdp2_dp2_on_four_ranks(reference, tmp_path):
    records = train(PP + ["pipeline=1f1b", "mesh.dp_size=2", "pipeline.pp_microbatch_size=1"],
                    tmp_path)
    assert_matches(records, reference())


def test_pp2_times_tp2_on_four_ranks(reference, tmp_path):
    records = train(PP + ["pipeline=1f1b", "mesh.tp_size=2"], tmp_path)
    assert_matches(records, reference())


@pytest.mark.parametrize("stages_per_rank,comms", [(1, False), (2, False), (2, True)])
def test_csv_schedule_matches_single_process(stages_per_rank, comms, reference, tmp_path):
    # 8 sequences / micro-batch size 2 = 4 micro-batches per step
    path = write_schedule_csv(tmp_path / "schedule.csv", pp=2, n_microbatches=4,
                              stages_per_rank=stages_per_rank, comms=comms)
    records = train(PP + ["pipeline=csv", f"pipeline.pp_schedule_csv={path}"], tmp_path)
    assert_matches(records, reference())
