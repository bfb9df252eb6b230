"""Helpers the CPU benchmarks share: resident memory from Linux's /proc, the closing lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def status(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM, RssAnon...), in
    bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Set the peak (VmHWM) to the current resident size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def finish(ok: bool, baseline: str, rtol: float, args, rows: list) -> None:
    """Say whether every run's losses matched ``baseline``'s, write ``--json``, and exit 1 on
    a mismatch."""
    print("loss ok" if ok else f"LOSS MISMATCH: some run differs from {baseline} by more "
          f"than {rtol:g} relative")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if not ok:
        sys.exit(1)


def run_ranks(overrides: list, entry, *args, name: str) -> list:
    """Resolve and check a job as ``train.py`` would (its whole preflight), run
    ``entry(cfg, *args)`` on its local ranks, and return their results in rank order."""
    import tempfile

    from automodel.api import load_config
    from automodel.checks.preflight import preflight
    from automodel.launch.local import run_on_local_ranks

    cfg = load_config(overrides, output_dir=tempfile.mkdtemp(prefix=f"{name}-"))
    preflight(cfg)
    results = run_on_local_ranks(entry, cfg.distributed.nproc_per_node, cfg, *args, name=name)
    return [results[r] for r in sorted(results)]


def add_run_arguments(p, batch: int, steps: int, warmup: int) -> None:
    """The options the CPU rank benchmarks share: batch, steps, warm-up, threads per rank,
    extra Hydra overrides, and a JSON output."""
    p.add_argument("--batch", type=int, default=batch, help="global batch (sequences per step)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup, help="steps left out of the medians")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override")
    p.add_argument("--json", help="also write the results here")


def check_run_arguments(p, args) -> None:
    if args.steps <= args.warmup:
        p.error("--steps must be larger than --warmup")
