"""The sweep report (``python -m automodel.sweep_report``) from a real local sweep."""

import json

import pytest

from automodel import sweep_report
from automodel.config.build import ConfigError
from automodel.costing.gpus import profile
from tests.cli.test_cli import QUICK, run


def _measured_peaks(path) -> list:
    """Each rank's largest peak_tensor_bytes of steps >= 2, read here from metrics.jsonl."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_rank = [r["peak_tensor_bytes_by_rank"] for r in records if r["step"] >= 2]
    return [max(column) for column in zip(*by_rank)]


def test_sweep_report_of_a_real_sweep(tmp_path):
    """`train.py -m parallelism=ddp,fsdp2` on 2 CPU ranks each (tensor bytes counted), plus a
    job refused by its checks in the same sweep folder (no metrics.jsonl): the report plans
    each job from its recorded overrides on 2 ranks, lists both layouts with the measured
    peak within 10% of the planned one, and lists the failed job with its reason."""
    sweep, common = tmp_path / "sweep", [*QUICK, "trainer.track_tensor_memory=true"]
    out = run(["-m", "parallelism=ddp,fsdp2", f"hydra.sweep.dir={sweep}", *common], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    bad = run(["parallelism=ddp", "mesh.tp_size=2", f"hydra.run.dir={sweep}/2", *common],
              tmp_path)
    assert bad.returncode == 2 and not (sweep / "2" / "metrics.jsonl").exists()

    assert sweep_report.main([str(sweep), "--out", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "sweep_report.md").read_text()
    rep = json.loads((tmp_path / "report" / "sweep_report.json").read_text())
    assert (tmp_path / "report" / "sweep_report.png").read_bytes()[:4] == b"\x89PNG"
    jobs = {j["job"]: j for j in rep["jobs"]}
    assert sorted(jobs) == [0, 1, 2]
    planned = {}
    for n, layout in ((0, "parallelism=ddp"), (1, "parallelism=fsdp2")):
        job = jobs[n]
        assert (job["status"], job["layout"], job["world_size"]) == ("ok", layout, 2)
        [cls] = job["classes"]  # one rank class: every rank
        assert cls["ranks"] == [0, 1]
        assert cls["measured_peak_bytes"] == max(_measured_peaks(sweep / str(n) /
                                                                 "metrics.jsonl"))
        assert abs(cls["planned_peak_bytes"] / cls["measured_peak_bytes"] - 1) <= 0.10
        assert job["measured_tokens_per_s"] > 0 and job["planned_tokens_per_s"] is None
        assert f"| #{n} | `{layout}` | 2 | every rank (ranks 0-1) |" in md
        planned[layout] = cls["planned_peak_bytes"]
    # each job is planned from its own overrides: FSDP2 shards what DDP replicates
    assert planned["parallelism=fsdp2"] < 0.8 * planned["parallelism=ddp"]
    # a CPU sweep without --gpu: the time is not compared, and the report says so
    assert not rep["planned_time_shown"] and "Time: not compared" in md
    assert "planned tokens/s" not in md
    failed = jobs[2]
    assert failed["status"] == "no metrics" and failed["classes"] == []
    assert "parallelism=ddp only replicates data" in failed["error"]
    assert "| #2 | `parallelism=ddp mesh.tp_size=2` | ? | **no metrics** (below) |" in md
    assert "- #2 (no metrics): no metrics.jsonl records" in md


def _plan(flops: float, comm: dict, layout: dict) -> dict:
    return {"layout": layout, "batch": {"global_batch_size": 8, "seq_len": 1024},
            "calibration": {}, "bubble": 0.2,
            "ranks": [{"flops": flops, "comm_bytes_per_step": comm}]}


@pytest.mark.fast
def test_calibration_sets_the_compute_efficiency_that_matches_the_measured_rate():
    """--calibrate JOB: the efficiency at which the cost model's step equals the job's
    measured one (tokens / tokens/s); with a tp all-reduce on the critical path too, and
    refused (naming the GPU) when the measured rate beats the profile's full peak."""
    gpu = profile("h100_80gb")
    plan = _plan(4e14, {}, {"dp_shard": 8})
    # compute only: step = flops / (peak * e) / (1 - bubble)
    step = 8 * 1024 / 1000.0
    e = sweep_report.calibrated_efficiency(plan, 1000.0, gpu)
    assert e == pytest.approx(4e14 / (gpu.peak_bf16_flops * step * 0.8), rel=1e-9)
    tp = _plan(4e14, {"tp": {"all_reduce": 10e9}}, {"tp": 8})
    exposed = 2 * 7 / 8 * 10e9 / (gpu.intra_node_bandwidth * gpu.comm_efficiency)
    e = sweep_report.calibrated_efficiency(tp, 1000.0, gpu)
    assert e == pytest.approx(4e14 / (gpu.peak_bf16_flops * (step * 0.8 - exposed)), rel=1e-9)
    with pytest.raises(ConfigError, match="faster than h100_80gb"):
        sweep_report.calibrated_efficiency(plan, 1e9, gpu)
