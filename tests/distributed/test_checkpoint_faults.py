"""Faults that must lose nothing: bad checkpoints, NaN steps, a killed rank, a killed save.

Faults are injected through ``AUTOMODEL_FAULTS`` (automodel/faults.py): real NaNs through the
real loss, real SIGKILLs of real rank processes.
"""

import hashlib
import os
import re
import shutil
import time

import pytest
import torch

from automodel.api import run as api_run
from automodel.checkpoint.hf_export import load_full_model_state
from automodel.checkpoint.paths import checkpoint_path, complete_checkpoints
from automodel.config.build import ConfigError
from automodel.errors import CheckpointError, LaunchError
from automodel.tracking.metrics import read_metrics
from tests.helpers import BASE, ON_CPU, train

RUN = ["trainer.max_steps=6", "checkpoint.every_steps=2"]
DDP = ["parallelism=ddp"]


def run(overrides, output_dir):
    """``automodel.api.run`` with the ranks pinned to the CPU (tests.helpers.ON_CPU)."""
    return api_run(ON_CPU + list(overrides), output_dir)


def _digest(root) -> dict:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), root)] = \
                    hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A DDP run of 6 steps with checkpoints at 2, 4, 6: (records, checkpoint root)."""
    out = tmp_path_factory.mktemp("good")
    return train(DDP + RUN, out), str(out / "checkpoints")


# ---------------------------------------------------------------- bad checkpoints
@pytest.mark.fast
def test_missing_checkpoint_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.resume=.*nowhere.*no such checkpoint"):
        run(BASE + DDP + [f"checkpoint.resume={tmp_path / 'nowhere'}"], str(tmp_path / "o"))


def test_incomplete_checkpoint_is_refused(good, tmp_path):
    broken = tmp_path / ".tmp-step_00000002"
    shutil.copytree(checkpoint_path(good[1], 2), broken)
    os.remove(broken / "trainer.json")
    with pytest.raises(ConfigError, match=r"\.tmp-step_00000002 is incomplete"):
        run(BASE + DDP + [f"checkpoint.resume={broken}"], str(tmp_path / "o"))


def test_truncated_checkpoint_is_refused_and_left_alone(good, tmp_path):
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(checkpoint_path(good[1], 2), ckpt)
    shard = sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0]
    with open(ckpt / shard, "r+b") as f:
        f.truncate(os.path.getsize(ckpt / shard) // 2)
    before = _digest(tmp_path)
    with pytest.raises(ConfigError, match=rf"step_00000002 is damaged: {shard} is truncated"):
        run(BASE + DDP + RUN + [f"checkpoint.resume={ckpt}", f"checkpoint.dir={tmp_path}"],
            str(tmp_path / "o"))
    assert _digest(tmp_path) == before  # nothing written, nothing overwritten


@pytest.mark.parametrize("name,model,message", [
    ("wider", ["model.config.hidden_size=96", "model.config.intermediate_size=256"],
     r"shapes differ: model\.lm_head\.weight \(checkpoint \[256, 64\], model \[256, 96\]\)"),
    ("shallower", ["model.config.num_hidden_layers=2"],
     r"in the checkpoint but not in the model: model\.model\.layers\.2\."),
])
def test_foreign_checkpoint_names_path_and_keys(name, model, message, good, tmp_path):
    ckpt = checkpoint_path(good[1], 2)
    before = _digest(good[1])
    with pytest.raises(LaunchError) as err:
        run(BASE + DDP + RUN + model + [f"checkpoint.resume={ckpt}"], str(tmp_path))
    text = str(err.value)
    assert f"checkpoint {ckpt} does not fit this model" in text
    assert re.search(message, text), text
    assert _digest(good[1]) == before
    assert complete_checkpoints(str(tmp_path / "checkpoints")) == []


def test_foreign_checkpoint_single_process(good, tmp_path):
    with pytest.raises(CheckpointError, match="shapes differ"):
        run(BASE + ["parallelism=none", "model.config.hidden_size=96",
                    "model.config.intermediate_size=256",
                    f"checkpoint.resume={checkpoint_path(good[1], 2)}"], str(tmp_path))


# ---------------------------------------------------------------- NaN
def test_nonfinite_loss_raises_and_saves_nothing_poisoned(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOMODEL_FAULTS", "nan@3")
    with pytest.raises(LaunchError, match=r"step 3: loss=nan grad_norm=nan is not finite.*"
                                          r"on_nonfinite=raise"):
        run(BASE + DDP + RUN, str(tmp_path))
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path / "checkpoints"))] \
        == ["step_00000002"]
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_nonfinite_step_is_skipped_with_skip(good, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOMODEL_FAULTS", "nan@3")
    records = train(DDP + ["trainer.max_steps=6", "checkpoint.every_steps=1",
                           "checkpoint.keep_last=null", "trainer.on_nonfinite=skip"], tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[2]["skipped"] and records[2]["loss"] != records[2]["loss"]  # NaN
    assert all("skipped" not in r for r in records[:2] + records[3:])
    good_records = good[0]
    assert [r["step"] for r in good_records[:2]] == [1, 2]
    assert [r["loss"] for r in records[:2]] == [r["loss"] for r in good_records[:2]]
    assert [r["grad_norm"] for r in records[:2]] == [r["grad_norm"] for r in good_records[:2]]
    root = str(tmp_path / "checkpoints")
    after_2 = load_full_model_state(checkpoint_path(root, 2))
    after_3 = load_full_model_state(checkpoint_path(root, 3))
    for key, value in after_2.items():  # the NaN step left the weights exactly as they were
        assert torch.equal(value, after_3[key]), key
    final = load_full_model_state(checkpoint_path(root, 6))
    assert all(torch.isfinite(v).all() for v in final.values())
    assert records[-1]["loss"] < records[1]["loss"]  # and training went on


# ---------------------------------------------------------------- killed rank, killed save
def test_killed_rank_ends_the_job_promptly_and_is_named(monkeypatch, tmp_path):
    # A hang would wait for the collective timeout (set to 10 minutes here); the job must end
    # within 60 s (measured: a few seconds after the kill, most of it start-up).
    monkeypatch.setenv("AUTOMODEL_FAULTS", "kill@3:1")
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        run(BASE + DDP + RUN + ["distributed.timeout_minutes=10"], str(tmp_path))
    elapsed = time.monotonic() - start
    assert "rank 1 failed (exit code -9)" in str(err.value)
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end after a rank died"


def test_save_killed_midway_leaves_previous_checkpoint_usable(good, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOMODEL_FAULTS", "kill_in_save@4:0")
    with pytest.raises(LaunchError, match="rank 0 failed"):
        run(BASE + DDP + RUN, str(tmp_path))
    root = tmp_path / "checkpoints"
    assert [os.path.basename(p) for p in complete_checkpoints(str(root))] == ["step_00000002"]
    assert os.path.isdir(root / ".tmp-step_00000004")  # the half-written save, ignored
    monkeypatch.delenv("AUTOMODEL_FAULTS")
    resumed = train(DDP + RUN + ["checkpoint.resume=auto"], tmp_path)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert [r["step"] for r in good[0][2:]] == [3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in good[0][2:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in good[0][2:]]
    assert not any(n.startswith(".tmp-") for n in os.listdir(root))  # cleaned up
