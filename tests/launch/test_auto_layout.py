"""``layout=auto`` (automodel/prepare/auto_layout.py): the planner's search chooses the layout for
the ranks at hand before any starts, the keys the user set bound it, and the run's config is
the printed command's. Real searches (probes simulated in worker processes) and a real run on
4 CPU ranks; the SLURM submitter's part is in tests/launch/test_slurm.py."""

import json
import logging
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from automodel.api import compose, load_config
from automodel.config.build import ConfigError
from automodel.prepare.auto_layout import allows, bounds_of, choose_layout
from tests.cli.test_cli import ROOT

TINY = ["distributed.backend=gloo", "trainer.max_steps=3", "trainer.log_every=1"]


BOUNDED = ["layout=auto", "distributed.nproc_per_node=4", "mesh.tp_size=2",
           "parallelism.activation_checkpointing=full", "trainer.track_tensor_memory=true",
           *TINY]


def test_layout_auto_on_four_ranks_trains_the_printed_layout(tmp_path, monkeypatch, caplog):
    """Within the keys set (tp 2, full checkpointing) the run prints its choice and the
    command of the same job without the search; that command's config is the run's own
    (``.hydra/config.yaml``), search.json and plan.json lie beside it, and it trains. The same
    search again (in this process) is the cached one."""
    run = tmp_path / "run"
    cache = tmp_path / "cache"
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *BOUNDED,
                          f"hydra.run.dir={run}"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env={**_env(), "AUTOMODEL_CACHE": str(cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    log = (run / "train.log").read_text()
    command = re.search(r"layout=auto chose .*; the same job without the search: "
                        r"python train\.py (.*)", log).group(1).split()
    saved = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert saved.layout == "manual"
    printed = compose(command)  # (the config the printed command composes)
    for section in ("mesh", "parallelism", "pipeline", "trainer", "distributed", "model"):
        assert OmegaConf.to_container(printed[section], resolve=True) == \
            OmegaConf.to_container(saved[section], resolve=True), section
    assert load_config(command).layout.world_size == 4
    plan = json.loads((run / "plan.json").read_text())
    assert plan["command"].split()[2:] == command
    assert json.loads((run / "search.json").read_text())["top"][0]["overrides"] == \
        plan["overrides"]
    assert plan["layout"]["tp"] == 2 and plan["layout"]["ac"] == "full"  # (the bounds)
    assert all(e["candidate"]["tp"] == 2 for e in json.loads(
        (run / "search.json").read_text())["top"])
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == [1, 2, 3]
    assert "trainer.plan_check_steps=3" in command  # (layout=auto checks its plan by default)
    assert_plan_check(run)
    # the same search again: the cache's (no probe runs; the choice is the same)
    monkeypatch.setenv("AUTOMODEL_CACHE", str(cache))
    caplog.set_level(logging.INFO, logger="automodel")
    again = tmp_path / "again"
    job = choose_layout(load_config(BOUNDED, output_dir=str(again)),
                        lambda o: load_config(o, output_dir=str(again)))
    assert "ran before: reusing" in caplog.text
    assert len(list((cache / "layout").glob("*.json"))) == 1
    assert (job.layout.tp, job.activation_checkpointing, job.layout_mode) == \
        (2, "full", "manual")
    assert json.loads((again / "plan.json").read_text())["overrides"] == plan["overrides"]


def assert_plan_check(run) -> None:
    """The run compared itself with the plan of its chosen layout: every planned rank class's
    peak within the planner's accuracy, its bytes per mesh axis the plan's."""
    record = json.loads((run / "plan_check.json").read_text())
    assert record["comparison"]["ranks"], record
    for r in record["comparison"]["ranks"]:
        if r["peak_bytes"]["measured"] is not None:
            assert 0.9 < r["peak_bytes"]["plan_over_run"] < 1.1, r
        assert r["comm_bytes"], r
        for axis, c in r["comm_bytes"].items():
            assert c["measured"] == pytest.approx(c["predicted"], rel=0.01), (axis, r)
    assert "plan check (steps" in (run / "train.log").read_text()


def _env():
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK",
                                                                       "WORLD_SIZE"))}


@pytest.mark.fast
def test_bounds_are_read_from_the_keys_and_a_fixed_layout_is_a_conflict():
    from automodel.planning.candidates import Candidate

    bounds = bounds_of(["mesh.tp_size=2", "pipeline=1f1b", "trainer.local_batch_size=2",
                        "parallelism.activation_checkpointing=false", "model=llama_tiny"])
    assert bounds == {"tp": 2, "schedule": "1f1b", "mbs": 2, "ac": "none"}
    keep = allows(bounds)
    assert keep(Candidate(1, 2, 2, 2, "1f1b", "none", 2))
    assert not keep(Candidate(1, 2, 2, 2, "interleaved", "none", 2))
    assert not keep(Candidate(1, 4, 1, 2, "1f1b", "none", 2))
    with pytest.raises(ConfigError, match="pipeline=zero_bubble is not one of them"):
        bounds_of(["pipeline=zero_bubble"])
    fixed = ["layout=auto", "distributed.nproc_per_node=4", "mesh.tp_size=2",
             "mesh.dp_size=2", "mesh.pp_size=1", "pipeline=none",
             "parallelism.activation_checkpointing=full", "trainer.local_batch_size=1"]
    with pytest.raises(ConfigError, match="the search has nothing to choose"):
        choose_layout(load_config(fixed), None)


def test_ranks_started_by_an_outer_launcher_do_not_search():
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": ""}
    cfg = load_config(["layout=auto"], env=torchrun)
    with pytest.raises(ConfigError, match="layout=auto under torchrun: each rank would search"):
        choose_layout(cfg, None)
    with pytest.raises(ConfigError, match=r"layout='sideways': allowed: manual, auto"):
        load_config(["layout=sideways"])


def test_a_model_that_fits_nowhere_is_refused_with_its_nearest_misses(tmp_path, monkeypatch):
    """Llama 3.1 8B on 2 CPU ranks sharing this machine's memory: no layout fits; the refusal
    names three layouts of different shapes and how much each lacks."""
    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(["model=llama3_1_8b", "layout=auto", "distributed.nproc_per_node=2",
                       "distributed.backend=gloo"], output_dir=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        choose_layout(cfg, None)
    text = str(err.value)
    assert "layout=auto: no layout of 2 cpu ranks fits this job" in text
    misses = re.findall(r"\n  \d\. (pp .*): needs (\d+\.\d) GiB more per device", text)
    assert len(misses) == 3 and len({m[0].split(", AC")[0] for m in misses}) == 3, text
    assert all(float(m[1]) > 0 for m in misses)


def test_a_qlora_search_weighs_only_the_layouts_the_preflight_lets_start(tmp_path,
                                                                          monkeypatch):
    """``layout=auto peft=qlora`` on 4 ranks: the TP layouts (NF4 weights do not split by
    columns) and those whose FSDP shards cut NF4 scale groups (the MLP's 22 groups over 4
    shards) are left out before the search, with the preflight's reasons; the search then
    chooses among the rest, and the chosen job passes the preflight."""
    from automodel.checks.preflight import preflight
    from automodel.prepare.auto_layout import search_and_choose
    from automodel.prepare.device_profiles import local_profile

    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path / "cache"))
    qlora = ["peft=qlora", "peft.nf4_scaler_block_size=8", "distributed.backend=gloo",
             "data=synthetic"]
    bound = ["parallelism.activation_checkpointing=false"]  # (a third of the probes)
    cfg = load_config(["layout=auto", "distributed.nproc_per_node=4", *qlora, *bound],
                      output_dir=str(tmp_path))
    result, chosen = search_and_choose(cfg, qlora, 4, local_profile(cfg))
    refused = result["refused_before_launch"]
    assert any(why.startswith("peft=qlora with mesh.tp_size=2: NF4 weights split only by "
                              "whole rows") for why in refused), refused
    assert any("does not split into 4 FSDP2 shards" in why for why in refused), refused
    assert all(e["candidate"]["tp"] == 1 for e in result["top"])
    job = load_config([*qlora, *chosen["overrides"], "distributed.nproc_per_node=4"],
                      output_dir=str(tmp_path / "job"))
    preflight(job, gpus=0)


@pytest.mark.fast
def test_the_search_cache_is_keyed_by_what_a_plan_depends_on(tmp_path):
    """The same config.json under two paths is one search; every key that changes a plan
    (the offload policy, the optimizer's path, the loss, the base's dtype) is another; what a
    plan ignores (the steps, the seed, the logger) is the same search."""
    from automodel.costing.gpus import profile
    from automodel.models.builder import hf_config
    from automodel.prepare.auto_layout import search_key

    for name in ("a", "b"):
        hf_config(load_config([]).model).save_pretrained(tmp_path / name)

    def key(*extra, path="a"):
        train = load_config(["model=pretrained", f"model.pretrained_path={tmp_path / path}",
                             "mesh.dp_size=1", *extra])
        return search_key(train, profile("h100_80gb"), 8, {})

    first = key()
    assert key(path="b") == first
    assert key("trainer.max_steps=7", "trainer.seed=3", "logger=wandb") == first
    changed = [key("optim.foreach=true"), key("trainer.loss=plain"),
               key("parallelism.offload_policy={_target_:torch.distributed.fsdp."
                   "CPUOffloadPolicy}"),
               key("peft=lora"), key("peft=lora", "peft.base_dtype=float32")]
    assert len({first, *changed}) == 6
