"""A checkpoint written under one layout resumes under another, and pipelines checkpoint too.

The source run is FSDP2 on two ranks (fp32). It is stopped after step 3 (a checkpoint is
written there) and resumed under each target layout; steps 4..6 must match the
uninterrupted FSDP2 run (fp32: only the order of reductions differs, rtol 1e-5).
"""

import numpy as np
import pytest

from automodel.checkpoint.paths import checkpoint_path
from tests.helpers import FP32, train

RUN = ["trainer.max_steps=6", "checkpoint.every_steps=3"]
SOURCE = ["parallelism=fsdp2", FP32]
PP = ["parallelism=fsdp2", FP32, "pipeline.pp_microbatch_size=2"]


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """(the uninterrupted records, the step-3 checkpoint of a run stopped there)."""
    root = tmp_path_factory.mktemp("fsdp2")
    full = train(SOURCE + RUN, root / "full")
    first = train(SOURCE + RUN + ["trainer.stop_at_step=3"], root / "split")
    assert [r["step"] for r in first] == [1, 2, 3]
    return full, checkpoint_path(str(root / "split" / "checkpoints"), 3)


def assert_continues(resumed, full, rtol=1e-5):
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["step"] for r in full[3:]] == [4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in full[3:]],
                               rtol=rtol)
    np.testing.assert_allclose([r["grad_norm"] for r in resumed],
                               [r["grad_norm"] for r in full[3:]], rtol=1e-4)
    # and the resumed run really continued (a fresh model would start near 5.6)
    assert resumed[0]["loss"] < full[0]["loss"] - 0.3


@pytest.mark.parametrize("name,layout", [
    ("ddp", ["parallelism=ddp"]),
    ("tp2", ["parallelism=fsdp2", FP32, "mesh.tp_size=2"]),
    ("pp2", PP + ["pipeline=1f1b"]),
    ("pp2_two_stages_per_rank", PP + ["pipeline=interleaved"]),
    ("single_process", ["parallelism=none"]),
])
def test_fsdp2_checkpoint_resumes_under(name, layout, fsdp2_run, tmp_path):
    full, ckpt = fsdp2_run
    resumed = train(layout + RUN + [f"checkpoint.resume={ckpt}"], tmp_path)
    assert_continues(resumed, full)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipeline_resume_is_exact_and_loads_single_process(schedule, tmp_path):
    layout = PP + [f"pipeline={schedule}"]
    full = train(layout + RUN, tmp_path / "full")
    train(layout + RUN + ["trainer.stop_at_step=4"], tmp_path / "split")
    again = train(layout + RUN + ["checkpoint.resume=auto"], tmp_path / "split")
    assert [r["step"] for r in again] == [4, 5, 6]
    assert [r["loss"] for r in again] == [r["loss"] for r in full[3:]]
    assert [r["grad_norm"] for r in again] == [r["grad_norm"] for r in full[3:]]
    # the pipeline's checkpoint (stages on different ranks) loads into one process
    ckpt = checkpoint_path(str(tmp_path / "full" / "checkpoints"), 3)
    single = train(["parallelism=none"] + RUN + [f"checkpoint.resume={ckpt}"], tmp_path / "one")
    assert_continues(single, full)
