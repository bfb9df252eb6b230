"""LoRA against full fine-tuning, and QLoRA against LoRA, of the same model, in one run each on
CPU: peak tensor bytes per rank, step time, and the checkpoint's size and save time.

Both train a Llama-style model built from config (``--hidden`` wide, ``--layers`` deep, fp32)
under FSDP2 on ``--ranks`` ranks, the same batches, ``--steps`` steps with a checkpoint at the
last; LoRA puts rank ``--rank`` adapters on the attention and MLP projections. Reported:

- **peak**: the largest ``peak_tensor_bytes`` of any rank and step (``trainer.
  track_tensor_memory``: live tensor bytes, the model's shards included);
- **step**: the median seconds per step after ``--warmup`` (from ``tokens_per_second``);
- **checkpoint**: the bytes of the saved step on disk and its save time (``train.log``).

Expected, with ``P`` the model's parameters and ``A`` the adapters' (fp32, AdamW, ``r`` ranks):
full fine-tuning holds ``4P/r`` of weights, ``4P/r`` of gradients and ``8P/r`` of AdamW states
per rank; LoRA ``4(P+A)/r`` of weights and ``12A/r`` of gradients and states, and its backward
skips the frozen weights' gradient matmuls (a third of the matmul work). Its checkpoint holds
``12A`` bytes against ``12P`` (weights and two moments). QLoRA stores the adapted layers'
weights (``Q`` of the ``P``) in NF4, about ``0.52Q`` bytes (half a byte a value, plus a scale
of one byte per 64 values and a float per 16,384) against ``4Q``, and dequantizes each weight
on every use (forward, backward, and the recompute under activation checkpointing): a
layer's full-precision copy lives while it computes.

    python benchmarks/lora.py                       # ~2 minutes on 2 cores
    python benchmarks/lora.py --hidden 1024 --layers 8 --json lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
from pathlib import Path

FP32 = ("parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
        "param_dtype:float32,reduce_dtype:float32}")


def _run(overrides: list, folder: Path) -> dict:
    from automodel.api import run

    out = tempfile.mkdtemp(dir=folder)
    records = run(overrides, output_dir=out)
    (step_dir,) = [p for p in (Path(out) / "checkpoints").iterdir() if p.name.startswith("step_")]
    size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    log = (Path(out) / "train.log").read_text()
    saves = [float(s) for s in re.findall(r"checkpoint saved: \S+ \(([\d.]+) s\)", log)]
    return {"records": records, "checkpoint_bytes": size, "save_s": saves[-1]}


def _summary(result: dict, warmup: int, tokens: int) -> dict:
    records = result["records"]
    peaks = [max(r["peak_tensor_bytes_by_rank"]) for r in records]
    steps = [tokens / r["tokens_per_second"] for r in records[warmup:]]
    return {"peak_bytes": max(peaks), "step_s": statistics.median(steps),
            "checkpoint_bytes": result["checkpoint_bytes"], "save_s": result["save_s"],
            "losses": [r["loss"] for r in records]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json")
    args = p.parse_args()
    h = args.hidden
    model = [f"model.config.hidden_size={h}", f"model.config.intermediate_size={h * 11 // 4}",
             f"model.config.num_hidden_layers={args.layers}",
             f"model.config.num_attention_heads={h // 64}",
             f"model.config.num_key_value_heads={max(1, h // 256)}",
             f"model.config.max_position_embeddings={args.seq}"]
    common = ["data=synthetic", "parallelism=fsdp2", FP32, f"mesh.dp_size={args.ranks}",
              f"trainer.max_steps={args.steps}", "trainer.log_every=1",
              f"trainer.seq_len={args.seq}", f"trainer.global_batch_size={args.batch}",
              "trainer.track_tensor_memory=true", f"checkpoint.every_steps={args.steps}",
              "distributed.backend=gloo"] + model
    adapters = [f"peft.rank={args.rank}", f"peft.alpha={2 * args.rank}"]
    runs = {"full": [], "lora": ["peft=lora"] + adapters, "qlora": ["peft=qlora"] + adapters}
    tokens = args.seq * args.batch
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        rows = {name: _summary(_run(common + extra, Path(tmp)), args.warmup, tokens)
                for name, extra in runs.items()}
    full, lora, qlora = rows["full"], rows["lora"], rows["qlora"]
    print(f"model: hidden {h}, {args.layers} layers; FSDP2 over {args.ranks} ranks (fp32); "
          f"{args.batch} x {args.seq} tokens a step; adapters of rank {args.rank}; QLoRA: "
          "NF4 blocks of 64, scale groups of 256 blocks")
    print(f"{'':10} {'peak/rank':>12} {'step s':>8} {'checkpoint':>12} {'save s':>8}")
    for name, r in rows.items():
        print(f"{name:10} {r['peak_bytes'] / 2**20:>9.1f} MiB {r['step_s']:>8.3f} "
              f"{r['checkpoint_bytes'] / 2**20:>9.1f} MiB {r['save_s']:>8.2f}")
    keys = ("peak_bytes", "step_s", "checkpoint_bytes", "save_s")
    ratios = {"lora/full": {k: lora[k] / full[k] for k in keys},
              "qlora/lora": {k: qlora[k] / lora[k] for k in keys}}
    for name, r in ratios.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows,
                                               "ratios": ratios}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
