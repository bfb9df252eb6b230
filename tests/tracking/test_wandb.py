"""logger=wandb in offline mode: the run file holds the config, the tags and every metric."""

import glob
import json
import os

import pytest

from automodel.config.schema import WandbConfig
from automodel.tracking.wandb_logger import init_kwargs, run_tags, stable_run_id
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
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in r.history.item}
            history[items["_step"]] = items
    assert sorted(history) == [r["step"] for r in records]
    for r in records:
        assert history[r["step"]]["loss"] == r["loss"]
        assert history[r["step"]]["grad_norm"] == r["grad_norm"]


@pytest.mark.fast  # no process, no process group (pytest -m fast)
def test_run_ids_survive_requeue_and_tags_skip_hydra():
    env = {"SLURM_JOB_ID": "42"}
    assert stable_run_id("/a", env) == stable_run_id("/b", env) == "slurm-42"
    assert stable_run_id("/a", {}) == stable_run_id("/a/", {}) != stable_run_id("/b", {})
    assert stable_run_id("/a", {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40",
                                "SLURM_ARRAY_TASK_ID": "3"}) == "slurm-40-3"
    tags = run_tags({"parallelism": "ddp", "hydra/launcher": "basic", "pipeline": None}, ["x"])
    assert tags == ["parallelism:ddp", "x"]
    assert os.environ.get("WANDB_MODE") == "offline"  # tests never reach the network


def test_wandb_mode_comes_from_the_environment_when_the_config_leaves_it_unset(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    records = train(["parallelism=none", "logger=wandb"], tmp_path / "run")
    assert records
    import wandb

    wandb.teardown()  # one rank ran in this process: wait until W&B's service wrote its files
    [run_file] = glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb"))
    pb = read_wandb_records(run_file)
    [run] = [r.run for r in pb if r.WhichOneof("record_type") == "run"]
    assert run.run_id == stable_run_id(str(tmp_path / "run"))
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["config"]["logger"]["wandb"]["mode"] is None  # the mode came from WANDB_MODE


def _kwargs(cfg=None, env=None, sweep_dir=None):
    return init_kwargs(cfg or WandbConfig(), "/out/job", {"a": 1}, {"parallelism": "ddp"},
                       ["parallelism=ddp"], sweep_dir, env=env if env is not None else {})


@pytest.mark.fast  # no process, no process group (pytest -m fast)
def test_init_kwargs_take_unset_keys_from_the_wandb_environment():
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "p", "WANDB_ENTITY": "e", "WANDB_DIR": "/w"}
    kw = _kwargs(env=env)
    assert (kw["mode"], kw["project"], kw["entity"], kw["dir"]) == ("offline", "p", "e", "/w")
    # neither config nor environment: mode and entity are left to W&B, the project is
    # "automodel", the files go to the output directory
    kw = _kwargs(env={})
    assert "mode" not in kw and "entity" not in kw
    assert kw["project"] == "automodel" and kw["dir"] == "/out/job"
    assert kw["name"] == "job" and kw["id"] == stable_run_id("/out/job", {})
    assert kw["group"] is None and kw["tags"] == ["parallelism:ddp"]
    assert kw["config"] == {"config": {"a": 1}, "choices": {"parallelism": "ddp"},
                            "overrides": ["parallelism=ddp"]}
    # values in the config win over the environment
    cfg = WandbConfig(project="mine", entity="team", mode="disabled", dir="/d", group="g",
                      name="n", id="i", tags=["t"])
    kw = _kwargs(cfg, env={"WANDB_MODE": "offline", "WANDB_PROJECT": "p", "WANDB_DIR": "/w"})
    assert (kw["project"], kw["entity"], kw["mode"], kw["dir"]) == ("mine", "team", "disabled",
                                                                     "/d")
    assert (kw["group"], kw["name"], kw["id"]) == ("g", "n", "i")
    assert kw["tags"] == ["parallelism:ddp", "t"]
    assert _kwargs(env={}, sweep_dir="/multirun/2024/sweep1/")["group"] == "sweep1"
