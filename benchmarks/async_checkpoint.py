"""Time a save stops training: blocking saves against background saves (``checkpoint.async_mode``).

    python benchmarks/async_checkpoint.py [--hidden 1024 --layers 8 --ranks 2 --json out.json]

One job per mode (none, thread, process), the same model, data and steps, FSDP2 over CPU
ranks: a Llama of ``--hidden`` x ``--layers`` (its fp32 weights and AdamW states are the
checkpoint's bytes: 16 bytes a parameter), a save every ``--every`` steps. From each job's
``train.log`` and ``metrics.jsonl``:

- blocked per save: the seconds training stood still for each save but the last (which always
  blocks): the whole write when blocking, the staging copy (and any wait for the save before)
  in the background modes;
- step time: the median step, and the median of the steps that ran while a write was in
  flight (the background write competes with them for the CPU);
- the job's wall time over its steps and saves.

The losses of every mode must be equal (the same job): the script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import finish  # noqa: E402

MODES = ("none", "thread", "process")


def job(args, mode: str, out: Path) -> list[str]:
    seq, batch = 128, 2 * args.ranks
    return ["distributed.backend=gloo", f"distributed.nproc_per_node={args.ranks}",
            "parallelism=fsdp2", "model=llama_tiny", f"model.config.hidden_size={args.hidden}",
            f"model.config.intermediate_size={4 * args.hidden}",
            f"model.config.num_hidden_layers={args.layers}",
            f"model.config.num_attention_heads={args.hidden // 64}",
            f"model.config.num_key_value_heads={args.hidden // 64}",
            f"model.config.vocab_size={args.vocab}", "data=synthetic",
            f"trainer.seq_len={seq}", f"trainer.global_batch_size={batch}",
            f"trainer.max_steps={args.steps}", "trainer.log_every=1",
            f"checkpoint.every_steps={args.every}", f"checkpoint.dir={out / 'checkpoints'}",
            "checkpoint.keep_last=2", f"checkpoint.async_mode={mode}"]


def measure(args, mode: str) -> dict:
    from automodel.api import run
    from automodel.tracking.metrics import read_metrics

    out = Path(tempfile.mkdtemp(prefix=f"async-{mode}-"))
    start = time.monotonic()
    run(job(args, mode, out), str(out))
    wall = time.monotonic() - start
    log = (out / "train.log").read_text()
    records = read_metrics(out / "metrics.jsonl")
    tokens = 128 * 2 * args.ranks
    steps = {r["step"]: tokens / r["tokens_per_second"] for r in records}
    if mode == "none":
        blocked = [float(s) for s in re.findall(r"checkpoint saved: \S+ \(([\d.]+) s\)", log)]
    else:
        blocked = [float(s) for s in re.findall(r"training blocked ([\d.]+) s", log)]
    blocked = blocked[:-1] if mode == "none" else blocked  # (the last save always blocks)
    during = [steps[s + k] for s in range(args.every, args.steps, args.every)
              for k in (1, 2) if s + k in steps]
    return {"mode": mode, "blocked_per_save_s": statistics.median(blocked),
            "saves": len(blocked), "step_s": statistics.median(steps.values()),
            "step_during_write_s": statistics.median(during), "wall_s": wall,
            "losses": [r["loss"] for r in records],
            "state_bytes": _state_bytes(out / "checkpoints")}


def _state_bytes(root: Path) -> int:
    last = sorted(root.glob("step_*"))[-1]
    return sum(p.stat().st_size for p in last.glob("*.distcp"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [measure(args, mode) for mode in MODES]
    print(f"checkpoint of {rows[0]['state_bytes'] / 2**20:.0f} MiB over {args.ranks} ranks, "
          f"a save every {args.every} steps")
    print(f"{'mode':8} {'blocked/save':>13} {'vs none':>8} {'step':>8} {'step in write':>14} "
          f"{'wall':>7}")
    base = rows[0]["blocked_per_save_s"]
    for r in rows:
        blocked = r["blocked_per_save_s"]
        print(f"{r['mode']:8} {blocked:12.2f}s {blocked / base:7.2f}x {r['step_s']:7.3f}s "
              f"{r['step_during_write_s']:13.3f}s {r['wall_s']:6.1f}s")
    ok = all(r["losses"] == rows[0]["losses"] for r in rows)
    finish(ok, "none", 0.0, args, rows)


if __name__ == "__main__":
    main()
