"""The planner against a real GPU: predicted peak memory and step time vs measured, on one GPU.

For each case (a 1B-8B model on one GPU, ``parallelism=fsdp2 mesh.dp_size=1``) it

1. plans the job: ``python plan.py <the case's overrides> plan.gpu=<profile>`` (the same
   overrides the run gets, so the plan describes exactly the job that runs), on the profile of
   the GPU found (``torch.cuda.get_device_name``: H100, H200, A100, B200; or ``--gpu``);
2. runs it for ``--steps`` steps in this process (``automodel.api.run``, one rank);
3. compares, over the steps after ``--warmup`` (the plan predicts a steady step):
   * the plan's ``peak_bytes`` (live tensors at the peak) with the CUDA allocator's
     ``max_memory_allocated`` of each step (``peak_tensor_bytes`` in metrics.jsonl; the run
     restarts the allocator's peak at each step's read), the largest over those steps;
   * the plan's peak plus its stated overhead with the allocator's reserved peak
     (``reserved_bytes.all.peak``) of the last step; its ``active_bytes.all.peak`` is shown
     too (on one rank it equals the allocated peak but for blocks freed on another stream);
   * the plan's ``step_time_s`` with the measured step (tokens per step / the median
     tokens/s).

It prints a table and writes everything to ``--out`` (JSON). ``--dry-run`` only plans (no GPU
needed: it runs on the CPU machine and writes the plans, which a later GPU run can take with
``--plans`` where ``plan.py`` cannot run, e.g. on an older torch).

    python benchmarks/plan_gpu_check.py --out plan_gpu_check.json          # on the GPU
    python benchmarks/plan_gpu_check.py --dry-run --gpu h200 --out plans.json   # anywhere
    python benchmarks/plan_gpu_check.py --plans plans.json --out check.json     # on the GPU

On a GPU machine without hydra-core/omegaconf, bring them as wheels (benchmarks/README.md,
``gpu_throughput.py``) and put them on ``PYTHONPATH``; ``plan.py`` runs as a subprocess with
the same interpreter and environment.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9

# The 0.95B Llama of gpu_throughput.py and its measured H200 run (hidden 2048, 16
# layers, 16 heads, vocabulary 32000), built from config with fp32 master weights.
_LLAMA_1B = ["model=llama_tiny", "model.config.vocab_size=32000",
             "model.config.hidden_size=2048", "model.config.intermediate_size=5632",
             "model.config.num_hidden_layers=16", "model.config.num_attention_heads=16",
             "model.config.num_key_value_heads=16",
             "model.config.max_position_embeddings=4096", "model.dtype=float32"]

CASES = {
    "llama_1b": ("0.95B Llama, fp32 master weights, FSDP2 (bf16 compute) on 1 rank, seq 2048, "
                 "batch 4, no AC", _LLAMA_1B + [
                     "trainer.seq_len=2048", "trainer.global_batch_size=4"]),
    "llama_1b_ac": ("the same with full activation checkpointing, batch 8",
                    _LLAMA_1B + ["trainer.seq_len=2048", "trainer.global_batch_size=8",
                                 "parallelism.activation_checkpointing=full"]),
    "llama3_1_8b_ac": ("Llama 3.1 8B (bf16 parameters and optimizer states), FSDP2 on 1 rank, "
                       "full AC, seq 4096, batch 1",
                       ["model=llama3_1_8b", "trainer.seq_len=4096",
                        "trainer.global_batch_size=1",
                        "parallelism.activation_checkpointing=full"]),
}


def job_overrides(case: str, steps: int) -> list[str]:
    """The overrides of both the plan and the run: the case's, one rank, synthetic data, a
    constant learning rate and a record every step."""
    return [*CASES[case][1], "parallelism=fsdp2", "mesh.dp_size=1",
            "distributed.nproc_per_node=1", "data=synthetic",
            f"data.num_sequences={max(64, 8 * steps)}", f"trainer.max_steps={steps}",
            "trainer.log_every=1", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0"]


def detect_gpu(requested: str | None) -> tuple[str, str | None]:
    """(the profile to plan for, the device's name or None without a GPU)."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if requested:
        return requested, name
    if name is None:
        return "h100_80gb", None
    for key, profile in (("H200", "h200"), ("H100", "h100_80gb"), ("A100", "a100_80gb"),
                         ("B200", "b200")):
        if key in name:
            return profile, name
    sys.exit(f"no shipped GPU profile matches {name!r}: pass --gpu PROFILE (and "
             "--gpu-spec FIELD=VALUE for its numbers)")


def make_plan(overrides: list, gpu: str, gpu_spec: list, out_dir: str) -> dict:
    """``python plan.py`` on ``overrides``, as a user runs it; its plan.json."""
    cmd = [sys.executable, str(ROOT / "plan.py"), *overrides, f"plan.gpu={gpu}",
           *[f"plan.gpu_spec.{kv}" for kv in gpu_spec], "plan.picture=false",
           f"hydra.run.dir={out_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"plan.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-6000:]}")
    plan = json.loads((Path(out_dir) / "plan.json").read_text())
    plan["plan_wall_s"] = time.perf_counter() - start
    return plan


def predicted(plan: dict) -> dict:
    """What the check compares, from a plan (one rank class at world size 1)."""
    [rank] = plan["ranks"]
    return {"peak_bytes": rank["peak_bytes"], "memory": rank["memory"],
            "overhead_bytes": rank["overhead_bytes"],
            "with_overhead_bytes": rank["peak_bytes"] + rank["overhead_bytes"],
            "fits": rank["fits"], "step_time_s": plan["step_time_s"], "time": plan["time"],
            "gpu": plan["gpu"]["name"], "command": plan["command"]}


def measure(overrides: list, warmup: int) -> dict:
    """Run the job in this process; the allocator's peaks and the step time."""
    import torch

    from automodel.api import run

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        records = sorted(run(overrides, output_dir=out), key=lambda r: r["step"])
    stats = torch.cuda.memory_stats()
    steady = records[warmup:] or records[-1:]
    peaks = [r.get("peak_tensor_bytes") or r["peak_memory_bytes"] for r in steady]
    tps = statistics.median(r["tokens_per_second"] for r in steady)
    gc.collect()
    torch.cuda.empty_cache()
    return {"max_memory_allocated": max(peaks), "per_step_peaks": peaks,
            "active_bytes_peak_last_step": stats.get("active_bytes.all.peak", 0),
            "reserved_bytes_peak_last_step": stats.get("reserved_bytes.all.peak", 0),
            "step_time_s": _tokens_per_step(overrides) / tps, "tokens_per_second": tps,
            "final_loss": records[-1]["loss"], "steps": len(records)}


def _tokens_per_step(overrides: list) -> int:
    value = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides}
    return int(value["trainer.seq_len"]) * int(value["trainer.global_batch_size"])


def compare(pred: dict, meas: dict) -> dict:
    def err(p, m):
        return (p - m) / m if m else None

    return {"peak_error": err(pred["peak_bytes"], meas["max_memory_allocated"]),
            "reserved_error": err(pred["with_overhead_bytes"],
                                  meas["reserved_bytes_peak_last_step"]),
            "step_time_error": err(pred["step_time_s"], meas["step_time_s"])}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def print_table(rows: list) -> None:
    print("\n| case | plan peak GB | measured max_allocated GB | error | active GB "
          "| plan + overhead GB | reserved GB | error | plan step s | measured step s "
          "| error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, m, e = r.get("predicted"), r.get("measured"), r.get("errors", {})
        if p is None:
            print(f"| {r['case']} | failed: {r['error'].splitlines()[0][:80]} |")
            continue
        cells = [f"{p['peak_bytes'] / GB:.2f}"]
        if m is None:
            cells += ["-", "-", "-", f"{p['with_overhead_bytes'] / GB:.2f}", "-", "-",
                      f"{p['step_time_s']:.3f}", "-", "-"]
        else:
            cells += [f"{m['max_memory_allocated'] / GB:.2f}", _pct(e["peak_error"]),
                      f"{m['active_bytes_peak_last_step'] / GB:.2f}",
                      f"{p['with_overhead_bytes'] / GB:.2f}",
                      f"{m['reserved_bytes_peak_last_step'] / GB:.2f}",
                      _pct(e["reserved_error"]), f"{p['step_time_s']:.3f}",
                      f"{m['step_time_s']:.3f}", _pct(e["step_time_error"])]
        print(f"| {r['case']} | " + " | ".join(cells) + " |")
    for r in rows:
        if "error" in r:
            print(f"\n{r['case']}: {r['error']}")


def run_case(case: str, args, gpu: str, stored: dict) -> dict:
    overrides = job_overrides(case, args.steps)
    row = {"case": case, "what": CASES[case][0], "overrides": overrides}
    try:
        if case in stored:
            if stored[case]["overrides"] != overrides:
                raise RuntimeError(f"--plans holds {case} for other overrides: plan it again")
            plan = stored[case]["plan"]
        else:
            with tempfile.TemporaryDirectory() as out:
                plan = make_plan(overrides, gpu, args.gpu_spec, out)
        row["plan"] = plan
        row["predicted"] = predicted(plan)
        print(f"{case}: plan {row['predicted']['peak_bytes'] / GB:.2f} GB peak, step "
              f"{row['predicted']['step_time_s']:.3f} s on {gpu}", flush=True)
        if not args.dry_run:
            row["measured"] = measure(overrides, args.warmup)
            row["errors"] = compare(row["predicted"], row["measured"])
    except Exception as err:  # (a case that fails, e.g. out of memory, leaves the others)
        row["error"] = f"{type(err).__name__}: {err}"
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out")
    p.add_argument("--gpu", help="GPU profile (default: the one matching the GPU found; "
                   "h100_80gb without a GPU)")
    p.add_argument("--gpu-spec", action="append", default=[], metavar="FIELD=VALUE",
                   help="a profile number replaced (plan.gpu_spec.FIELD=VALUE)")
    p.add_argument("--dry-run", action="store_true", help="plan only (no GPU needed)")
    p.add_argument("--plans", help="the plans of an earlier --dry-run --out FILE, used "
                   "instead of running plan.py here")
    p.add_argument("--out", default="plan_gpu_check.json", help="JSON results")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must be larger than --warmup")
    gpu, device_name = detect_gpu(args.gpu)
    if device_name is None and not args.dry_run:
        p.error("no CUDA GPU here: use --dry-run to plan only")
    stored = {}
    if args.plans:
        stored = {r["case"]: r for r in json.loads(Path(args.plans).read_text())["rows"]
                  if "plan" in r}
    print(f"GPU: {device_name or 'none'}; profile {gpu}", flush=True)
    rows = [run_case(case, args, gpu, stored) for case in args.cases]
    print_table(rows)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "device": device_name, "profile": gpu,
        "torch": __import__("torch").__version__, "rows": rows}, indent=1))
    print(f"\nwrote {os.path.abspath(args.out)}")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
