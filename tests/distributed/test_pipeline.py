"""Pipeline parallelism: every schedule matches a single process (fp32, rtol 1e-5)."""

import pytest

from automodel.config.pipeline_layout import SCHEDULE_SHAPES, canonical_schedule
from automodel.distributed.pipelining.schedule import SCHEDULES, schedule_spec
from tests.distributed.test_parity import assert_close_to_fp32, assert_matches, assert_same_steps
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


@pytest.mark.parametrize("name,overrides", [
    ("static_shapes", ["pipeline=1f1b", "pipeline.pp_seq_len=32"]),
    ("static_shapes_interleaved", ["pipeline=interleaved", "pipeline.pp_seq_len=32"]),
    ("explicit_parts", ["pipeline=1f1b", "pipeline.module_fqns_per_model_part=[[model.embed_tokens,"
                        "model.layers.0],[model.layers.1,model.layers.2,model.layers.3,"
                        "model.norm,lm_head]]"]),
    ("layers_per_stage_rounded", ["pipeline=interleaved", "pipeline.layers_per_stage=3",
                                  "pipeline.round_virtual_stages_to_pp_multiple=up"]),
    ("nosync_over_two_schedule_steps_fsdp_dp2",
     ["pipeline=gpipe", "mesh.dp_size=2", "pipeline.pp_batch_size=2",
      "pipeline.pp_microbatch_size=1", "pipeline.patch_stage_backward_maybe_with_nosync=true"]),
    ("dualpipev", ["pipeline=1f1b", "pipeline.pp_schedule=DualPipeV",
                   "pipeline.pp_microbatch_size=1"]),
])
def test_more_pipeline_options_keep_parity(name, overrides, reference, tmp_path):
    assert_matches(train(PP + overrides, tmp_path), reference())


def test_custom_loss_fn_drives_the_gradients(reference, tmp_path):
    # Twice the loss: reported loss doubles; Adam is scale-invariant, so the trajectory of the
    # true loss stays that of the reference (to Adam's epsilon).
    records = train(PP + ["pipeline=1f1b", "pipeline.loss_fn=tests.distributed.plans."
                          "summed_ce_times_two"], tmp_path)
    ref = reference()
    assert_same_steps(records, ref)
    for r, q in zip(records, ref):
        assert abs(r["loss"] - 2 * q["loss"]) < 1e-4 * q["loss"]
        assert abs(r["grad_norm"] - 2 * q["grad_norm"]) < 1e-3 * q["grad_norm"]


def test_pipeline_dtype_bfloat16_is_close_to_fp32(reference, tmp_path):
    # (grad-norm tolerances and their measured basis: test_parity.assert_close_to_fp32)
    records = train(PP + ["pipeline=1f1b", "pipeline.dtype=bfloat16", "pipeline.pp_seq_len=32",
                          "parallelism.mp_policy=null"], tmp_path)
    assert_close_to_fp32(records, reference(), loss_rtol=3e-2, differ_rtol=1e-5)


def test_pipeline_with_autocast_is_close_to_fp32(reference, tmp_path):
    records = train(PP + ["pipeline=1f1b", "parallelism.autocast_dtype=bfloat16"], tmp_path)
    assert_close_to_fp32(records, reference(), loss_rtol=2e-2)  # (autocast really ran in bf16)


def test_recv_buffer_pool_gives_identical_losses_and_predicted_memory(tmp_path):
    # 8 micro-batches, pp=2, slack 2: stage 0 pools its gradient buffers in 2-0+2 = 4 sets,
    # stage 1 its activation buffers in 2-1+2 = 3; unpooled, each has 8.
    base = PP + ["pipeline=1f1b", "pipeline.pp_microbatch_size=1"]
    plain = train(base, tmp_path / "plain")
    pooled = train(base + ["pipeline.pp_recv_buffer_pool=true"], tmp_path / "pooled")
    assert_same_steps(pooled, plain)
    assert [r["loss"] for r in pooled] == [r["loss"] for r in plain]  # bit for bit
    assert [r["grad_norm"] for r in pooled] == [r["grad_norm"] for r in plain]
    ratio = pooled[-1]["pp_recv_buffer_bytes"] / plain[-1]["pp_recv_buffer_bytes"]
    assert ratio == (4 + 3) / (8 + 8)
    smaller_slack = train(base + ["pipeline.pp_recv_buffer_pool=true",
                                  "pipeline.pp_recv_buffer_pool_slack=0"], tmp_path / "slack0")
    assert smaller_slack[-1]["pp_recv_buffer_bytes"] / plain[-1]["pp_recv_buffer_bytes"] == \
        (2 + 1) / 16
    assert_same_steps(smaller_slack, plain)
    assert [r["loss"] for r in smaller_slack] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in smaller_slack] == [r["grad_norm"] for r in plain]


def test_recv_buffer_pool_is_ignored_with_a_warning_for_other_schedules(reference, tmp_path):
    # (1f1b and interleaved 1F1B are pooled: here and test_pipeline_recv_pool_interleaved.py)
    records = train(PP + ["pipeline=gpipe", "pipeline.pp_recv_buffer_pool=true"], tmp_path)
    assert_matches(records, reference())
    assert "pp_recv_buffer_pool applies to the 1f1b and interleaved_1f1b (or dfs) schedules " \
        "only; ignored for gpipe" in (tmp_path / "train.log").read_text()


# ----------------------------------------------------------------- names -> torch classes
DOC_SCHEDULES = {  # the table of docs/pipeline.md, "Schedules" (checked below)
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "dfs": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "v_schedule": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
V_PLACED = {"v_schedule", "DualPipeV"}
# the conf/pipeline/<name>.yaml files, and the pp_schedule each selects
PIPELINE_FILES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved_1f1b",
                  "looped_bfs": "looped_bfs", "dfs": "dfs", "zero_bubble": "zero_bubble",
                  "v_schedule": "v_schedule"}


@pytest.mark.fast
@pytest.mark.parametrize("name,torch_class", sorted(DOC_SCHEDULES.items()))
def test_schedule_name_runs_the_documented_torch_class(name, torch_class):
    from torch.distributed.pipelining import schedules

    # the doc's names are config-group names (interleaved) or pp_schedule values (DualPipeV)
    key = PIPELINE_FILES.get(name, name)
    spec = schedule_spec(key)
    assert spec.cls is getattr(schedules, torch_class), (name, spec.cls)
    assert spec.multi_stage == (name not in ("1f1b", "gpipe"))
    assert spec.v_placement == (name in V_PLACED)
    # torch's own class name (without "Schedule"), in any case, gives the same class
    for alias in (torch_class[len("Schedule"):], torch_class[len("Schedule"):].upper()):
        assert schedule_spec(alias).cls is spec.cls, alias


@pytest.mark.fast
def test_every_schedule_and_config_file_is_in_the_doc_table():
    from tests.cli.test_cli import ROOT

    assert {PIPELINE_FILES.get(n, n).lower() for n in DOC_SCHEDULES} == set(SCHEDULES)
    assert set(SCHEDULES) == set(SCHEDULE_SHAPES)
    files = {p.stem for p in (ROOT / "conf" / "pipeline").glob("*.yaml")}
    assert files - {"none", "csv"} == set(PIPELINE_FILES)


@pytest.mark.fast
def test_the_pipeline_doc_lists_the_schedules():
    """docs/pipeline.md's schedule table holds exactly these rows: name -> torch class."""
    import re

    from tests.cli.test_cli import ROOT

    text = (ROOT / "docs" / "pipeline.md").read_text()
    rows = re.findall(r"^\| `(?:pipeline\.pp_schedule=)?(\w+)` \| `(Schedule\w+)` \|", text,
                      re.MULTILINE)
    assert len(rows) == len(DOC_SCHEDULES) and dict(rows) == DOC_SCHEDULES, rows


@pytest.mark.fast
@pytest.mark.parametrize("group,pp_schedule", sorted(PIPELINE_FILES.items()))
def test_pipeline_config_file_selects_its_schedule(group, pp_schedule):
    from automodel.api import compose

    # composed as `python train.py pipeline=<group>` would (conf/pipeline/<group>.yaml)
    assert compose(["parallelism=fsdp2", f"pipeline={group}"]).pipeline.pp_schedule == \
        pp_schedule
    assert canonical_schedule(pp_schedule) == pp_schedule
    assert schedule_spec(pp_schedule).cls.__name__ == DOC_SCHEDULES[group]
