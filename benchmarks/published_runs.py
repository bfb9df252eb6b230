"""The GPU profiles' default efficiencies, derived from published training runs.

Each run below was measured on real GPUs by its authors (named in ``SOURCE``); this script
plans the same job (model, GPUs, batch, sequence, checkpointing, plain loss as they ran it)
on the profile of that GPU and fits the compute efficiency at which the plan's tokens/s is
the published one (``planning/calibrate.fit_calibration``). The profiles' defaults
(``automodel/costing/gpus.py``) are these fits, rounded down; docs/planning.md ("GPU
profiles") has the table this prints. Planning only: no GPU needed, about 10 s a run here.

    python benchmarks/published_runs.py [--fit] [--out published_runs.json]

Without ``--fit`` it prints, for each run, the plan with the shipped defaults beside the
published tokens/s and memory (what the closing notes quote).

A GPU with no published bf16 training run (B200) takes its efficiency from ``TRANSFERS``: one
framework's published runs of the same job on it and on a GPU that has a fitted efficiency
(H100), both in FP8. The job is planned once, costed on both profiles, and the new GPU's
efficiency is the one at which the plan's speed-up over the fitted GPU is the published one:
the new GPU is assumed to keep, in bf16, the share of the other's utilization it keeps in FP8.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHTITAN = ("torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024): H100 SXM "
              "96 GB HBM2e at a 500 W limit, 8 GPUs a host on NVLink, 400 Gb/s RDMA per GPU; "
              "throughput read at step 90")
TORCHTITAN_A100 = "torchtitan, docs/performance.md (2024): 64 A100 80GB, FSDP2"
AUTOMODEL_H200 = ("this project (2026-11-30): one H200, "
                  "benchmarks/gpu_throughput.py, median of steps 6-25")
MEGATRON_BRIDGE = ("Megatron-Bridge, docs/performance-summary.md, NeMo container 25.11: "
                   "LLAMA3_8B pretraining on 8 GPUs, FP8 current scaling, global batch 128 "
                   "x 8,192 tokens; 30,624 tokens/s/GPU on DGX-B200, 14,451 on DGX-H100")
# (torchtitan's: float32 parameters and states, bfloat16 compute, the full logits' loss)
LLAMA_8B = ["model=llama3_1_8b", "model.dtype=float32", "trainer.seq_len=8192",
            "trainer.loss=plain"]
H200_095B = ["model=llama_tiny", "model.config.vocab_size=32000",
             "model.config.hidden_size=2048", "model.config.intermediate_size=5632",
             "model.config.num_hidden_layers=16", "model.config.num_attention_heads=16",
             "model.config.num_key_value_heads=16", "model.config.max_position_embeddings=2048",
             "model.dtype=float32", "trainer.seq_len=2048", "trainer.global_batch_size=4"]
RUNS = [
    {"name": "llama3.1-8b fsdp 8xH100", "gpu": "h100_80gb", "gpus": 8, "source": TORCHTITAN,
     "overrides": LLAMA_8B + ["trainer.global_batch_size=16",
                              "parallelism.activation_checkpointing=selective"],
     "tokens_per_s_per_gpu": 5762, "memory_gib": 82.4, "fit": True},
    {"name": "llama3.1-8b fsdp 128xH100", "gpu": "h100_80gb", "gpus": 128, "source": TORCHTITAN,
     "overrides": LLAMA_8B + ["trainer.global_batch_size=256",
                              "parallelism.activation_checkpointing=selective"],
     "tokens_per_s_per_gpu": 5605, "memory_gib": 67.0, "fit": False},
    {"name": "llama3-8b fsdp 64xA100", "gpu": "a100_80gb", "gpus": 64, "source": TORCHTITAN_A100,
     "overrides": LLAMA_8B + ["trainer.global_batch_size=64",
                              "parallelism.activation_checkpointing=selective"],
     "tokens_per_s_per_gpu": 2904, "memory_gib": None, "fit": True},
    {"name": "llama 0.95b fsdp2 1xH200", "gpu": "h200", "gpus": 1, "source": AUTOMODEL_H200,
     "overrides": H200_095B + ["trainer.loss=plain"],
     "tokens_per_s_per_gpu": 47900, "memory_gib": 27.8 * 1e9 / 2**30, "fit": True},
]

# the speed-up of ``gpu`` over the GPU of run ``over`` in one framework's runs of one job
TRANSFERS = [
    {"name": "llama3-8b 8xB200 over 8xH100", "gpu": "b200", "over": "llama3.1-8b fsdp 8xH100",
     "source": MEGATRON_BRIDGE, "speedup": 30624 / 14451, "gpus": 8,
     "overrides": LLAMA_8B + ["trainer.global_batch_size=128", "trainer.local_batch_size=1",
                              "parallelism.activation_checkpointing=false"]},
]


def plan_run(run: dict, out: str) -> dict:
    """plan.py of the published job, as a user would run it."""
    args = [sys.executable, os.path.join(ROOT, "plan.py"), *run["overrides"], "data=synthetic",
            f"plan.gpu={run['gpu']}", f"plan.gpus={run['gpus']}", "plan.picture=false",
            f"hydra.run.dir={out}"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"{run['name']}: plan.py failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "plan.json")) as f:
        return json.load(f)


def row(run: dict, plan: dict) -> dict:
    from automodel.costing.calibrate import check_entry, fit_calibration

    per_gpu = plan["tokens_per_s"] / plan["world_size"]
    published_step = plan["step_time_s"] * per_gpu / run["tokens_per_s_per_gpu"]
    fitted, note = fit_calibration(check_entry(plan), published_step)
    peak = max(r["peak_bytes"] + r["overhead_bytes"] for r in plan["ranks"]) / 2**30
    return {"run": run["name"], "gpu": run["gpu"], "gpus": run["gpus"],
            "published_tokens_per_s_per_gpu": run["tokens_per_s_per_gpu"],
            "planned_tokens_per_s_per_gpu": round(per_gpu),
            "plan_over_published": per_gpu / run["tokens_per_s_per_gpu"],
            "compute_efficiency_used": plan["gpu"]["compute_efficiency"],
            "fitted_compute_efficiency": fitted.get("compute_efficiency"), "fit_note": note,
            # the efficiency at which the compute alone takes the published step
            "compute_only_efficiency": plan["gpu"]["compute_efficiency"]
            * plan["time"]["compute_s"] / published_step,
            "published_memory_gib": run["memory_gib"],
            "planned_peak_plus_overhead_gib": peak, "source": run["source"]}


def transfer_row(transfer: dict, plan: dict, over_efficiency: float | None = None) -> dict:
    """``plan`` (the transfer's job, planned on the other GPU's profile) costed on both: the
    planned speed-up at the shipped defaults, and the efficiency of ``transfer["gpu"]`` at which
    it is the published one, the other GPU at ``over_efficiency`` (its fit; None: its default)."""
    from automodel.costing.calibrate import check_entry, fit_calibration, predicted_step
    from automodel.costing.gpus import profile

    over = check_entry(plan)
    new = {**over, "gpu": profile(transfer["gpu"]).as_dict()}
    at = {} if over_efficiency is None else {"compute_efficiency": over_efficiency}
    fitted, note = fit_calibration(new, predicted_step(over, {**over["calibration"], **at})
                                   / transfer["speedup"])
    planned = predicted_step(over) / predicted_step(new)
    return {"run": transfer["name"], "gpu": transfer["gpu"], "over": plan["gpu"]["name"],
            "published_speedup": transfer["speedup"], "planned_speedup": planned,
            "speedup_plan_over_published": planned / transfer["speedup"],
            "compute_efficiency_used": new["gpu"]["compute_efficiency"],
            "over_compute_efficiency_used": plan["gpu"]["compute_efficiency"],
            "over_fitted_compute_efficiency": over_efficiency,
            "fitted_compute_efficiency": fitted.get("compute_efficiency"), "fit_note": note,
            "source": transfer["source"]}


def transfers(rows: list[dict]) -> list[dict]:
    """``TRANSFERS``' rows, each planned on its fitted GPU's profile, that GPU at its fit."""
    out = []
    for transfer in TRANSFERS:
        run = next(r for r in RUNS if r["name"] == transfer["over"])
        fit = next((r["fitted_compute_efficiency"] for r in rows if r["run"] == run["name"]),
                   None)
        with tempfile.TemporaryDirectory() as tmp:
            plan = plan_run({**transfer, "gpu": run["gpu"]}, tmp)
        out.append(transfer_row(transfer, plan, fit))
        r = out[-1]
        print(f"{r['run']}: published speed-up x{r['published_speedup']:.3f}; planned "
              f"x{r['planned_speedup']:.3f} at the defaults ({r['compute_efficiency_used']} "
              f"over {r['over_compute_efficiency_used']}); fitted compute_efficiency "
              f"{r['fitted_compute_efficiency']:.3f} ({r['over']} at its fit, "
              f"{r['over_fitted_compute_efficiency']})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="only the runs the defaults "
                        "are fitted to")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    rows = []
    for run in RUNS:
        if args.fit and not run["fit"]:
            continue
        with tempfile.TemporaryDirectory() as out:
            rows.append(row(run, plan_run(run, out)))
        r = rows[-1]
        memory = (f"{r['published_memory_gib']:.1f} GiB" if r["published_memory_gib"]
                  else "n/a")
        print(f"{r['run']}: published {r['published_tokens_per_s_per_gpu']} tok/s/GPU, "
              f"{memory}; planned {r['planned_tokens_per_s_per_gpu']} tok/s/GPU "
              f"(x{r['plan_over_published']:.2f}) at compute_efficiency "
              f"{r['compute_efficiency_used']}, peak+overhead "
              f"{r['planned_peak_plus_overhead_gib']:.1f} GiB; fitted compute_efficiency "
              f"{r['fitted_compute_efficiency']:.3f} (compute alone: "
              f"{r['compute_only_efficiency']:.3f})", flush=True)
    rows += transfers(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
