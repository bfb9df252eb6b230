"""plan.search: the layouts it enumerates, how it estimates one from probes, and a real search
whose best layout, planned in full, matches its estimate."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from automodel.planning.gpus import profile
from automodel.planning.probes import PROBE_DEPTHS, LayerCosts, layer_costs, probe_overrides
from automodel.planning.search import Candidate, candidates, estimate

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.fast
def test_candidates_keep_tp_in_a_node_divide_heads_and_batch():
    found = candidates(64, 8, heads=32, kv_heads=8, layers=32, global_batch=256)
    assert {c.tp for c in found} == {1, 2, 4, 8}
    assert all(c.dp_replicate * c.dp_shard * c.tp * c.pp == 64 for c in found)
    assert all(256 % (c.dp_replicate * c.dp_shard) == 0 for c in found)
    # a pipeline needs at least pp micro-batches per step; interleaving two stages per rank
    for c in found:
        micro = 256 // (c.dp_replicate * c.dp_shard) // c.mbs
        assert c.pp == 1 or micro >= c.pp
        assert (c.schedule == "none") == (c.pp == 1)
    # 6 kv heads: tp must divide them (and the node)
    assert {c.tp for c in candidates(8, 8, 12, 6, 4, 8)} == {1, 2}
    # HSDP replicas are whole nodes: dp_shard x tp = the GPUs of a node
    assert all(c.dp_shard * c.tp == 8 for c in found if c.dp_replicate > 1)
    assert candidates(64, 8, 32, 8, 32, global_batch=7) == []


def _costs(tp=1, ac="none"):
    # one layer: 100 B of state on 2 FSDP ranks, 1000 B of activation per sequence, 10 FLOPs,
    # 50 B gathered and 80 B reduce-scattered; the rest: 40 B state, 7 B/sequence, 3 fixed
    return LayerCosts(tp, ac, layer_state=100, layer_activation=1000, layer_flops=10,
                      layer_comm={"dp_shard": {"all_gather": 50, "reduce_scatter": 80}},
                      rest_state=40, rest_peak=7, rest_fixed=3, rest_flops=5,
                      rest_comm={"dp_shard": {"reduce_scatter": 20}})


@pytest.mark.fast
def test_estimate_adds_up_state_activations_and_deferred_gradients():
    gpu = profile("h100_80gb")
    model = {"layers": 4, "hidden": 8, "embed_share": 0.5, "head_share": 0.5}
    job = {"global_batch": 8, "seq_len": 16, "activation_bytes": 2}
    one = estimate(Candidate(1, 4, 1, 1, "none", "none", 2), _costs(), model, job, gpu)
    [rank] = one["ranks"]
    # state / (4 / 2); 2 sequences of activation per layer; rest: 7 per sequence + 3
    assert rank["peak_bytes"] == int((4 * 100 + 40) / 2 + 4 * 1000 * 2 + 7 * 2 + 3)
    assert rank["flops"] == (4 * 10 + 5) * 2 * 1  # 8 / 4 ranks / 2 per micro-batch = 1
    assert rank["comm"]["dp_shard"] == {"all_gather": 4 * 50, "reduce_scatter": 4 * 80}
    # micro-batch 1: 2 micro-batches, so FSDP2 keeps the unsharded gradients between them
    two = estimate(Candidate(1, 4, 1, 1, "none", "none", 1), _costs(), model, job, gpu)
    assert two["ranks"][0]["peak_bytes"] == int(
        (4 * 100 + 40) / 2 + 4 * 1000 + 7 + 3 + 4 * 80 + 20)
    assert two["ranks"][0]["comm"]["dp_shard"]["all_gather"] == 2 * 4 * 50  # per micro-batch
    # what a layer adds beyond its state and activations (its gradient, a reduction's
    # buffers) is counted once per layer, not per sequence
    fixed = estimate(Candidate(1, 4, 1, 1, "none", "none", 2),
                     dataclasses.replace(_costs(), layer_fixed=30), model, job, gpu)
    assert fixed["peak_bytes"] - one["peak_bytes"] == 4 * 30
    # where the optimizer's step holds more (states, gradients, its temporaries: 5000 B a
    # layer on 2 ranks, 900 B the rest), that is the peak
    stepping = dataclasses.replace(_costs(), layer_optimizer_peak=5000, rest_optimizer_peak=900)
    big = estimate(Candidate(1, 4, 1, 1, "none", "none", 2), stepping, model, job, gpu)
    assert big["ranks"][0]["peak_bytes"] == int((4 * 5000 + 900) / 2)


@pytest.mark.fast
def test_estimate_of_a_pipeline_uses_the_schedules_in_flight_micro_batches():
    gpu = profile("h100_80gb")
    model = {"layers": 4, "hidden": 8, "embed_share": 0.5, "head_share": 0.5}
    job = {"global_batch": 8, "seq_len": 16, "activation_bytes": 2}
    est = estimate(Candidate(1, 2, 1, 2, "1f1b", "none", 1), _costs(), model, job, gpu)
    first, last = est["ranks"]
    # 1F1B with 4 micro-batches over 2 ranks: rank 0 holds 2 at once, rank 1 holds 1; the
    # last rank holds the loss (7 B per sequence)
    assert first["peak_bytes"] - last["peak_bytes"] == 2 * 1000 * 2 - 2 * 1000 * 1 - 7
    assert first["comm"]["pp"]["send"] == 16 * 8 * 2 * 4  # a micro-batch's hidden states
    assert est["bubble"] == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)


@pytest.mark.fast
def test_layer_costs_are_the_difference_of_two_depths():
    def sim(layers):
        return {"memory": {"parameters_sharded": 10 + 5 * layers, "optimizer_states": 20 +
                           10 * layers, "parameters_unsharded": 4, "temporary": 2,
                           "activations": 40 + 150 * layers},
                "peak_bytes": 100 + 215 * layers, "flops": 7 + 3 * layers,
                "comm": {"tp": {"all_reduce": 9 + 6 * layers}},
                "optimizer_peak_bytes": 50 + 40 * layers}
    assert PROBE_DEPTHS == (4, 5)
    wide = sim(4)
    wide["peak_bytes"] += 4 * 150 + 11  # (a second sequence: its activations, 11 B of rest)
    c = layer_costs(2, "full", sim(4), sim(5), wide)
    assert (c.layer_state, c.layer_activation, c.layer_flops) == (15, 150, 3)
    assert c.layer_fixed == 50  # (the peak's growth beyond state and activations)
    assert (c.rest_state, c.rest_flops) == (30, 7)
    assert c.rest_peak + c.rest_fixed == 100 - 30 and c.rest_peak == 11
    assert c.layer_comm == {"tp": {"all_reduce": 6}} and c.rest_comm == {"tp": {"all_reduce": 9}}
    assert (c.layer_optimizer_peak, c.rest_optimizer_peak) == (40, 50)
    over = probe_overrides(["model=llama_tiny", "mesh.tp_size=8", "pipeline=1f1b",
                            "parallelism=ddp", "data=synthetic"], 2, "none", 3, 64)
    assert "mesh.tp_size=8" not in over and "pipeline=none" in over
    assert "parallelism.activation_checkpointing=false" in over and "data=synthetic" in over
    assert "++model.config.num_hidden_layers=3" in over and "parallelism=fsdp2" in over


def test_a_search_prints_commands_and_its_best_layout_planned_in_full_matches(tmp_path):
    """8 GPUs (nodes of 4) for Llama 3.1 8B cut to 8 layers (the simulation costs the same
    for any width): the layouts that fit, fastest first, the best re-planned by the full
    simulation within 10% of its estimate; each printed command is train.py's."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "plan.py"), "model=llama3_1_8b",
         "model.config.num_hidden_layers=8", "trainer.seq_len=4096",
         "trainer.global_batch_size=16", "plan.search=true", "plan.gpus=8", "plan.top=3",
         "+plan.gpu_spec.gpus_per_node=4", "plan.workers=2", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "search.json").read_text())
    assert result["searched"] > 20 and len(result["top"]) == 3
    times = [float(f"{e['step_time_s']:.4g}") for e in result["top"]]
    assert times == sorted(times) and all(e["fits"] for e in result["top"])
    for e in result["top"]:
        assert e["command"].startswith("python train.py model=llama3_1_8b")
        assert e["command"] in out.stdout
    best = result["best_planned"]
    assert best["peak_bytes"] == pytest.approx(best["estimated_peak_bytes"], rel=0.10)
    assert best["step_time_s"] == pytest.approx(best["estimated_step_time_s"], rel=0.10)


@pytest.mark.fast
def test_search_refuses_the_layout_it_chooses_and_takes_any_batch():
    from automodel.config.build import ConfigError
    from automodel.planning.search import resolve_for_search

    with pytest.raises(ConfigError, match=r"mesh\.tp_size=8 pipeline=1f1b sets part of it"):
        resolve_for_search(["model=llama_tiny", "mesh.tp_size=8", "pipeline=1f1b"])
    # the job's own settings resolve as one rank: a batch that the default layout of the
    # GPUs would not divide is the search's to match (its candidates divide it)
    cfg = resolve_for_search(["model=llama_tiny", "trainer.global_batch_size=6"])
    assert cfg.layout.world_size == 1 and cfg.trainer.global_batch_size == 6


@pytest.mark.fast
def test_the_fastest_estimates_are_planned_in_full_until_one_fits(monkeypatch):
    import automodel.planning.search as search

    fits = {"a": False, "b": True, "c": True}
    monkeypatch.setattr(search, "_confirm", lambda base, e, gpu, cfg: {
        "fits": fits[e["id"]], "peak_bytes": 90 * 2**30})
    fitting = [{"id": k} for k in "abc"]
    refused, best = search._confirm_fastest([], fitting, None, None)
    assert [e["id"] for e in refused] == ["a"] and best["id"] == "b"
    assert "planned" not in fitting[2]  # (planned only until one fits)
    refused[0].update(peak_bytes=70 * 2**30, command="python train.py X")
    text = search.search_summary({"searched": 3, "gpus": 8, "gpu": {"name": "h100_80gb"},
                                  "fitting": 3, "top": [], "refused_in_full": refused})
    assert "left out: estimated 70.0 GiB, planned in full 90.0 GiB" in text
