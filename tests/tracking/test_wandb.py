"""logger=wandb in offline mode: the run file holds the config, the tags and every metric."""

import glob
import json
import os

from automodel.tracking.wandb_logger import run_tags, stable_run_id
from tests.helpers import read_wandb_records, train


def test_offline_run_holds_config_tags_and_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    records = train(["parallelism=ddp", "logger=wandb", "logger.wandb.mode=offline",
                     "logger.wandb.tags=[nightly]"], tmp_path / "run")
    [run_file] = glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb"))
    pb = read_wandb_records(run_file)
    [run] = [r.run for r in pb if r.WhichOneof("record_type") == "run"]
    assert run.run_id == stable_run_id(str(tmp_path / "run"))
    assert run.job_type == "train" and "nightly" in run.tags
    assert "parallelism:ddp" in run.tags and "model:llama_tiny" in run.tags
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["config"]["trainer"]["max_steps"] == 5
    assert config["config"]["parallelism"]["bucket_cap_mb"] is None
    assert config["choices"]["parallelism"] == "ddp"
    assert "parallelism=ddp" in config["overrides"]
    history = {}
    for r in pb:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
    assert sorted(history) == [r["step"] for r in records]
    for r in records:
        assert history[r["step"]]["loss"] == r["loss"]
        assert history[r["step"]]["grad_norm"] == r["grad_norm"]


def test_run_ids_survive_requeue_and_tags_skip_hydra():
    env = {"SLURM_JOB_ID": "42"}
    assert stable_run_id("/a", env) == stable_run_id("/b", env) == "slurm-42"
    assert stable_run_id("/a", {}) == stable_run_id("/a/", {}) != stable_run_id("/b", {})
    assert stable_run_id("/a", {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40",
                                "SLURM_ARRAY_TASK_ID": "3"}) == "slurm-40-3"
    tags = run_tags({"parallelism": "ddp", "hydra/launcher": "basic", "pipeline": None}, ["x"])
    assert tags == ["parallelism:ddp", "x"]
    assert os.environ.get("WANDB_MODE") == "offline"  # tests never reach the network
