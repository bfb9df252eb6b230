"""Checkpoints: exact resume on the same layout, atomic directories, keep_last."""

import os

import pytest

from automodel.checkpoint.paths import complete_checkpoints
from tests.helpers import FP32, train

RUN = ["trainer.max_steps=6", "checkpoint.every_steps=2"]


@pytest.mark.parametrize("layout", [pytest.param(["parallelism=none"], marks=pytest.mark.fast),
                                    ["parallelism=ddp"],
                                    ["parallelism=fsdp2", FP32],
                                    ["parallelism=fsdp2", FP32, "mesh.tp_size=2"]])
def test_resume_continues_bit_for_bit(layout, tmp_path):
    full = train(layout + RUN, tmp_path / "full")
    first = train(layout + RUN + ["trainer.stop_at_step=3"], tmp_path / "split")
    assert [r["step"] for r in first] == [1, 2, 3]
    second = train(layout + RUN + ["checkpoint.resume=auto"], tmp_path / "split")
    # resumed after step 2 (the last checkpoint): steps 3..6 again, equal to the full run
    assert [r["step"] for r in second] == [r["step"] for r in full[2:]] == [3, 4, 5, 6]
    assert [r["loss"] for r in second] == [r["loss"] for r in full[2:]]
    assert [r["grad_norm"] for r in second] == [r["grad_norm"] for r in full[2:]]


def test_atomic_directories_and_keep_last(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    os.makedirs(root / ".tmp-step_00000099")  # a save that was interrupted
    train(["parallelism=ddp", "checkpoint.keep_last=2"] + RUN, tmp_path / "run")
    assert [os.path.basename(p) for p in complete_checkpoints(str(root))] == [
        "step_00000004", "step_00000006"]
    assert not any(n.startswith(".tmp-") for n in os.listdir(root))
    # a rerun from step 4 saves step 6 again: the new one replaces the old one whole
    before = os.stat(root / "step_00000006" / "trainer.json").st_mtime_ns
    again = train(["parallelism=ddp", "checkpoint.keep_last=2",
                   f"checkpoint.resume={root / 'step_00000004'}"] + RUN, tmp_path / "run")
    assert [r["step"] for r in again] == [5, 6]
    assert [os.path.basename(p) for p in complete_checkpoints(str(root))] == [
        "step_00000004", "step_00000006"]
    assert os.stat(root / "step_00000006" / "trainer.json").st_mtime_ns > before
    assert sorted(os.listdir(root)) == ["step_00000004", "step_00000006"]
