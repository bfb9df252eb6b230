"""Saves that do not stop training (``checkpoint.async_mode``): what they write, when it becomes
visible, and what a fault leaves.

Real ranks (FSDP2 over 2 gloo ranks under the default bf16 policy, so the state is DTensor
shards of fp32 master weights), real background threads
and processes; the fault drills (automodel/faults.py) hold a write back (``slow_save``: the
steps after a save run while it waits), kill a rank inside one, or fail it as a full disk
does.
"""

import os
import re

import pytest
import torch

from automodel.api import load_config
from automodel.api import run as api_run
from automodel.checkpoint.hf_export import load_full_model_state
from automodel.checkpoint.paths import checkpoint_path, complete_checkpoints
from automodel.config.build import ConfigError
from automodel.errors import LaunchError
from tests.helpers import BASE, ON_CPU, train

# the default mixed precision (bf16 compute, fp32 master weights): what users save
FSDP2 = ["parallelism=fsdp2", "mesh.dp_size=2"]
RUN = ["trainer.max_steps=6", "checkpoint.every_steps=2"]


@pytest.fixture(scope="module")
def blocking(tmp_path_factory):
    """The same job with blocking saves: (records, checkpoint root)."""
    out = tmp_path_factory.mktemp("blocking")
    return train(FSDP2 + RUN, out), str(out / "checkpoints")


def _log(out) -> str:
    return (out / "train.log").read_text()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_background_saves_write_what_blocking_saves_write(mode, blocking, tmp_path,
                                                          monkeypatch):
    """Each write waits 1 s (``slow_save``) while the next steps update the weights: the
    checkpoints still hold the weights of their own step (the staged copy), equal to the
    blocking run's; training went on during the write; a save due while one is writing waits
    for it; the losses are the blocking run's."""
    monkeypatch.setenv("AUTOMODEL_FAULTS", "slow_save@1")
    records = train(FSDP2 + RUN + [f"checkpoint.async_mode={mode}"], tmp_path)
    assert [(r["loss"], r["grad_norm"]) for r in records] == \
        [(r["loss"], r["grad_norm"]) for r in blocking[0]]
    for step in (2, 4, 6):
        got = load_full_model_state(checkpoint_path(str(tmp_path / "checkpoints"), step))
        want = load_full_model_state(checkpoint_path(blocking[1], step))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), step
    log = _log(tmp_path)
    staged = log.index("checkpoint staged: ")
    assert "step_00000002 (training blocked" in log[staged:]
    # step 3 ran before step 2's checkpoint was written, and step 4's save waited for it
    assert staged < log.index("step 3/6") < log.index("checkpoint written: ")
    assert "checkpoint of step 2 still being written: the save of step 4 waits for it" in log
    assert "checkpoint saved: " in log  # (the last save blocks)


def test_a_background_save_killed_midway_leaves_the_previous_checkpoint(blocking, tmp_path,
                                                                         monkeypatch):
    """Rank 0 killed inside step 4's background save (its shards written, the checkpoint not
    complete): only step 2's checkpoint is visible; resuming from it trains steps 3 to 6
    exactly as the uninterrupted run."""
    monkeypatch.setenv("AUTOMODEL_FAULTS", "kill_in_save@4:0")
    with pytest.raises(LaunchError, match="rank 0 failed"):
        api_run(ON_CPU + BASE + FSDP2 + RUN + ["checkpoint.async_mode=thread"], str(tmp_path))
    root = str(tmp_path / "checkpoints")
    assert [os.path.basename(p) for p in complete_checkpoints(root)] == ["step_00000002"]
    monkeypatch.delenv("AUTOMODEL_FAULTS")
    resumed = train(FSDP2 + RUN + ["checkpoint.async_mode=thread", "checkpoint.resume=auto"],
                    tmp_path)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == \
        [(r["loss"], r["grad_norm"]) for r in blocking[0][2:]]


def test_a_failed_background_write_ends_the_job_naming_its_cause(tmp_path, monkeypatch):
    """Rank 1's write of step 4 fails as a full disk does: the job ends, naming the save, the
    rank and the cause; step 2's checkpoint stays the last complete one."""
    monkeypatch.setenv("AUTOMODEL_FAULTS", "enospc_in_save@4:1")
    with pytest.raises(LaunchError) as err:
        api_run(ON_CPU + BASE + FSDP2 + RUN + ["checkpoint.async_mode=thread"], str(tmp_path))
    text = str(err.value)
    assert re.search(r"the background save of step 4's checkpoint \(.*step_00000004\) failed: "
                     r"rank 1: .*No space left on device", text), text
    root = str(tmp_path / "checkpoints")
    assert [os.path.basename(p) for p in complete_checkpoints(root)] == ["step_00000002"]


# a training timeout of 6 s; rank 1's background write of step 2 starts 10 s after rank 0's
SLOW_RANK = ["trainer.max_steps=4", "distributed.timeout_minutes=0.1",
             "checkpoint.async_mode=thread"]


def test_a_background_write_keeps_the_save_timeout_while_one_rank_trails(tmp_path,
                                                                         monkeypatch):
    """The background save's group keeps ``checkpoint.save_timeout_minutes`` (30 by default)
    across the training steps, whose own timeout is 6 s here: rank 1's write, 10 s behind
    rank 0's (``slow_save`` on rank 1 only), completes. With a save timeout of 3 s the same
    write fails, naming the timeout (the option is what kept it alive)."""
    monkeypatch.setenv("AUTOMODEL_FAULTS", "slow_save@10:1")
    records = train(FSDP2 + RUN + SLOW_RANK, tmp_path / "kept")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [os.path.basename(p) for p in complete_checkpoints(
        str(tmp_path / "kept" / "checkpoints"))] == ["step_00000002", "step_00000004"]
    assert "checkpoint written: " in _log(tmp_path / "kept")  # (step 2's, in the background)
    with pytest.raises(LaunchError) as err:
        api_run(ON_CPU + BASE + FSDP2 + RUN + SLOW_RANK + ["checkpoint.save_timeout_minutes=0.05"],
                str(tmp_path / "short"))
    assert re.search(r"the background save of step 2's checkpoint .* failed: rank 0: .*"
                     r"Timed out", str(err.value)), str(err.value)


@pytest.mark.fast  # one process, no process group
def test_async_options_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.async_mode=thread saves in the "
                                          r"background, but checkpoint.every_steps is null"):
        load_config(["checkpoint.async_mode=thread"], str(tmp_path))
    with pytest.raises(ConfigError, match=r"checkpoint.pinned_memory=true .* but "
                                          r"checkpoint.async_mode=none"):
        load_config(["checkpoint.every_steps=2", "checkpoint.pinned_memory=true"],
                    str(tmp_path))
    from automodel.checks.preflight import preflight

    cfg = load_config(["checkpoint.every_steps=2", "checkpoint.async_mode=process",
                       "checkpoint.pinned_memory=true"], str(tmp_path))
    with pytest.raises(ConfigError, match=r"pinned_memory=true .* train on the CPU \(the "
                                          r"job's ranks have no GPU\)"):
        preflight(cfg, gpus=0)
