"""The plan beside the run on CPU ranks, before and after calibration.

Each layout below runs for real on 2 CPU ranks with ``trainer.plan_check_steps`` (its plan made
before the ranks start, on the CPU ranks' own profile), so each run's ``plan_check.json`` holds
its measured step time and peaks beside the uncalibrated plan's. Then every layout is planned
again with ``plan.calibrate_from`` set to the first run (FSDP2 over 2 ranks): the other
layouts' step times predicted from one measured run.

    python benchmarks/plan_check_cpu.py [--steps 12] [--out table.md]

Prints a markdown table (layout, measured step, planned before, planned after calibration
from the first run, peak planned / measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["distributed.nproc_per_node=2", "distributed.backend=gloo", "data=synthetic",
          "trainer.track_tensor_memory=true", "trainer.log_every=1"]
LAYOUTS = {
    "fsdp2 dp 2": ["parallelism=fsdp2"],
    "fsdp2 tp 2 + SP": ["parallelism=fsdp2", "mesh.tp_size=2",
                        "parallelism.sequence_parallel=true"],
    "fsdp2 pp 2 1F1B": ["parallelism=fsdp2", "mesh.pp_size=2", "pipeline=1f1b"],
    "ddp dp 2": ["parallelism=ddp"],
}


def run(script: str, args: list[str], out: str) -> None:
    done = subprocess.run([sys.executable, os.path.join(ROOT, script), *args,
                           f"hydra.run.dir={out}"], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, overrides in LAYOUTS.items():
            out = os.path.join(tmp, name.replace(" ", "_"))
            run("train.py", [*COMMON, *overrides, f"trainer.max_steps={args.steps}",
                             f"trainer.plan_check_steps={args.steps}"], out)
            with open(os.path.join(out, "plan_check.json")) as f:
                runs[name] = (out, json.load(f))
        source = runs[next(iter(LAYOUTS))][0]
        for name, overrides in LAYOUTS.items():
            out, record = runs[name]
            planned = os.path.join(out, "calibrated")
            run("plan.py", [*COMMON, *overrides, f"plan.calibrate_from={source}",
                            "plan.picture=false"], planned)
            with open(os.path.join(planned, "plan.json")) as f:
                after = json.load(f)["step_time_s"]
            m = record["measured"]
            peaks = [r["peak_bytes"]["plan_over_run"] for r in record["comparison"]["ranks"]]
            rows.append(f"| {name} | {m['step_time_s'] * 1e3:.1f} ms (+-"
                        f"{m['step_time_spread_s'] * 1e3:.1f}) | "
                        f"{record['check']['step_time_s'] * 1e3:.2f} ms "
                        f"({record['check']['step_time_s'] / m['step_time_s']:.3f}) | "
                        f"{after * 1e3:.1f} ms ({after / m['step_time_s']:.3f}) | "
                        f"{', '.join(f'{p:.3f}' for p in peaks)} |")
    table = "\n".join(["| layout (2 CPU ranks) | measured step | planned before (plan/run) | "
                       f"planned after, calibrated from {next(iter(LAYOUTS))} (plan/run) | "
                       "peak plan/run per rank class |", "|---|---|---|---|---|", *rows])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
