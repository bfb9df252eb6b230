"""``checkpoint.resume=auto`` on a resubmission: the same command, a new timestamped output
directory. With ``experiment=NAME`` the checkpoints live in ``outputs/NAME/checkpoints``, shared
by every submission, so the second submission continues the first (bit for bit, fp32 on CPU)
and continues its W&B run; without a stable directory ``resume=auto`` is refused up front.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from automodel.config.build import ConfigError
from automodel.config.checkpoint_dir import resolve_checkpoint
from automodel.config.schema import CheckpointConfig
from tests.cli.test_cli import TRAIN, cli_args
from tests.helpers import BASE, read_wandb_records

# the reference fixture's job (single process), as a user would type it
COMMAND = cli_args(BASE + ["parallelism=none", "experiment=sft", "checkpoint.every_steps=2",
                           "checkpoint.resume=auto", "logger=wandb",
                           "logger.wandb.mode=offline"])


def _submit(cwd, env_extra=None):
    env = dict(os.environ, WANDB_DIR=str(cwd / "wandb_dir"), **(env_extra or {}))
    return subprocess.run([sys.executable, TRAIN] + COMMAND, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _wandb_runs(cwd) -> list:
    """(run id, history steps) of each offline W&B run, oldest first."""
    runs = []
    for path in sorted(glob.glob(str(cwd / "wandb_dir" / "wandb" / "offline-run-*"))):
        [run_file] = glob.glob(os.path.join(path, "run-*.wandb"))
        pb = read_wandb_records(run_file)
        [run] = [r.run for r in pb if r.WhichOneof("record_type") == "run"]
        steps = [json.loads(i.value_json) for r in pb if r.WhichOneof("record_type") ==
                 "history" for i in r.history.item
                 if (i.key or "/".join(i.nested_key)) == "_step"]
        runs.append((run.run_id, run.display_name, steps))
    return runs


def test_resubmitted_command_continues_run_and_wandb_run(reference, tmp_path):
    full = reference()  # the uninterrupted run: steps 1-5
    first = _submit(tmp_path, {"AUTOMODEL_FAULTS": "raise@4"})  # dies before step 4
    assert first.returncode == 1, first.stderr
    ckpts = tmp_path / "outputs" / "sft" / "checkpoints"
    assert "checkpoint.resume=auto: looked in " + str(ckpts) + " and found no complete " \
           "checkpoint; starting at step 0" in first.stdout + first.stderr
    again = _submit(tmp_path)  # the same command
    assert again.returncode == 0, again.stderr
    assert (f"checkpoint.resume=auto: looked in {ckpts} and found the checkpoint of step 2 "
            f"({ckpts / 'step_00000002'}); resuming from it") in again.stdout + again.stderr
    runs = sorted(glob.glob(str(tmp_path / "outputs" / "*" / "*" / "metrics.jsonl")))
    assert len(runs) == 2  # two submissions, two timestamped output directories
    records = [[json.loads(line) for line in open(path)] for path in runs]
    assert [r["step"] for r in records[0]] == [1, 2, 3]
    assert [r["step"] for r in records[1]] == [3, 4, 5]  # from the checkpoint of step 2
    for got in records[0] + records[1]:
        want = full[got["step"] - 1]
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"])
    (id1, name1, steps1), (id2, name2, steps2) = _wandb_runs(tmp_path)
    assert id1 == id2 and name1 == name2 == "sft"  # the W&B run continues
    assert (steps1, steps2) == ([1, 2, 3], [3, 4, 5])
    assert json.loads((ckpts / "step_00000005" / "trainer.json").read_text())[
        "wandb_run_id"] == id1


def test_resume_auto_without_a_stable_directory_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, TRAIN] + cli_args(["checkpoint.resume=auto"]),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "checkpoint.resume=auto: checkpoint.dir is null" in proc.stderr
    assert "Set experiment=NAME" in proc.stderr and "checkpoint.dir=PATH" in proc.stderr
    assert "step 1/" not in proc.stdout + proc.stderr  # (2: refused before launch)


@pytest.mark.fast
def test_checkpoint_dir_from_experiment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    auto = CheckpointConfig(resume="auto")
    out = str(tmp_path / "outputs" / "2024-01-01" / "10-00-00")
    got = resolve_checkpoint(auto, "sft", out, None, output_named_by_time=True)
    assert got.dir == str(tmp_path / "outputs" / "sft" / "checkpoints")
    assert auto.dir is None  # (a copy)
    sweep = str(tmp_path / "multirun" / "d" / "t")
    got = resolve_checkpoint(auto, "sft", sweep + "/3", sweep, output_named_by_time=True)
    assert got.dir == str(tmp_path / "outputs" / "sft" / "3" / "checkpoints")
    mine = CheckpointConfig(resume="auto", dir="/data/ckpt")
    assert resolve_checkpoint(mine, "sft", out, None, True).dir == "/data/ckpt"
    assert resolve_checkpoint(auto, None, out, None, False).dir is None  # a fixed output dir
    with pytest.raises(ConfigError, match="checkpoint.resume=auto: checkpoint.dir is null"):
        resolve_checkpoint(auto, None, out, None, output_named_by_time=True)
    with pytest.raises(ConfigError, match="experiment='a/b'"):
        resolve_checkpoint(auto, "a/b", out, None, True)


@pytest.mark.fast
def test_output_directory_named_by_time_is_seen_on_every_rank():
    from omegaconf import OmegaConf

    from automodel.config.compose import named_by_time

    def hc(run_dir, hydra_overrides=()):
        return OmegaConf.create({"run": {"dir": run_dir}, "sweep": {"dir": "/fixed/sweep"},
                                 "overrides": {"hydra": list(hydra_overrides)}})
    timed = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    assert named_by_time(hc(timed), multirun=False, env={})
    assert not named_by_time(hc("/fixed"), multirun=False, env={})
    assert not named_by_time(hc(timed), multirun=True, env={})  # (sweep.dir is fixed)
    # torchrun's other ranks run in hydra.run.dir=. (cli.prepare_argv); rank 0 in the user's
    torchrun = {"TORCHELASTIC_RUN_ID": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2"}
    assert named_by_time(hc(".", ["hydra.run.dir=."]), multirun=False, env=torchrun)
    assert not named_by_time(hc(".", ["hydra.run.dir=/fixed", "hydra.run.dir=."]),
                              multirun=False, env=torchrun)
