"""parallelism=megatron_fsdp against FSDP2 on ONE NVIDIA GPU: losses, grad norms, speed, memory,
and checkpoints (save, resume, resume into FSDP2).

Prepared for a machine with a GPU (megatron-fsdp needs CUDA). Where the GPU machine's Python
lacks the project's dependencies, bring them as wheels (hydra-core, omegaconf, antlr4,
megatron-fsdp), install them with ``pip install --no-deps --target /tmp/site`` and run with
``PYTHONPATH=/tmp/site:$PWD`` (see ``benchmarks/README.md``, gpu_throughput.py).
World size 1 throughout (``distributed.nproc_per_node=1``: the rank runs in-process).

    python benchmarks/megatron_fsdp_gpu.py                      # ~1B Llama, 12 steps each
    python benchmarks/megatron_fsdp_gpu.py --hidden 512 --layers 4 --vocab 8192 --steps 8

Runs (same model from config, same seed, same batches, bf16 compute):

1. ``fsdp2``: automodel's default mixed precision (bf16 parameters, fp32 reduction);
2. ``megatron_fsdp``: zero 3, fp32 main weights and gradients
   (``preserve_fp32_weights=true grad_reduce_in_fp32=true``);
3. ``megatron_fsdp`` stopped after step ``--steps // 2`` (a checkpoint), then resumed: the
   resumed steps must repeat run 2's;
4. ``fsdp2`` resumed from run 3's checkpoint: a Megatron-FSDP checkpoint in an FSDP2 layout.

Printed: per-step losses and gradient norms of runs 1 and 2 with their largest relative
difference (bf16: expect about 1e-2), tokens/s (median after the warmup) and peak GPU memory,
and whether the resumed runs continue as they should. Exit status 1 if something fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def overrides(args, strategy: str, *extra: str) -> list[str]:
    mfsdp = (["parallelism.preserve_fp32_weights=true", "parallelism.grad_reduce_in_fp32=true",
              "parallelism.autocast_dtype=bfloat16"] if strategy == "megatron_fsdp" else [])
    return [f"parallelism={strategy}", *mfsdp, "distributed.nproc_per_node=1",
            "model=llama_tiny", f"model.config.hidden_size={args.hidden}",
            f"model.config.intermediate_size={args.hidden * 11 // 4}",
            f"model.config.num_hidden_layers={args.layers}",
            f"model.config.num_attention_heads={args.heads}",
            f"model.config.num_key_value_heads={args.heads}",
            f"model.config.vocab_size={args.vocab}",
            f"model.config.max_position_embeddings={args.seq}",
            "data=synthetic", f"data.num_sequences={args.batch * args.steps}",
            f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
            f"trainer.seq_len={args.seq}", "trainer.log_every=1", "optim.warmup_steps=0",
            "optim.min_lr_ratio=1.0", *extra]


def summary(records, warmup: int) -> dict:
    return {"tokens_per_second": statistics.median(r["tokens_per_second"]
                                                   for r in records[warmup:]),
            "peak_gb": max(r.get("peak_memory_bytes", 0) for r in records) / 1e9,
            "losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records]}


def rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def main(argv=None) -> int:
    from automodel.api import run
    from automodel.checkpoint.paths import checkpoint_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="mfsdp-"))
    half = args.steps // 2
    ckpt = [f"checkpoint.every_steps={half}"]
    out: dict = {}
    fsdp2 = run(overrides(args, "fsdp2"), output_dir=str(root / "fsdp2"))
    mfsdp = run(overrides(args, "megatron_fsdp", *ckpt), output_dir=str(root / "mfsdp"))
    out["fsdp2"], out["megatron_fsdp"] = summary(fsdp2, args.warmup), summary(mfsdp, args.warmup)
    out["loss_rel_diff"] = rel(out["megatron_fsdp"]["losses"], out["fsdp2"]["losses"])
    out["grad_norm_rel_diff"] = rel(out["megatron_fsdp"]["grad_norms"],
                                    out["fsdp2"]["grad_norms"])
    run(overrides(args, "megatron_fsdp", *ckpt, f"trainer.stop_at_step={half}"),
        output_dir=str(root / "split"))
    saved = checkpoint_path(str(root / "split" / "checkpoints"), half)
    resumed = run(overrides(args, "megatron_fsdp", f"checkpoint.resume={saved}"),
                  output_dir=str(root / "resumed"))
    into_fsdp2 = run(overrides(args, "fsdp2", f"checkpoint.resume={saved}"),
                     output_dir=str(root / "into_fsdp2"))
    later = [r["loss"] for r in mfsdp[half:]]
    out["resume_rel_diff"] = rel([r["loss"] for r in resumed], later)
    out["into_fsdp2_rel_diff"] = rel([r["loss"] for r in into_fsdp2], later)
    for name in ("fsdp2", "megatron_fsdp"):
        s = out[name]
        print(f"{name:14s} {s['tokens_per_second']:9.0f} tok/s  peak {s['peak_gb']:6.2f} GB  "
              f"losses {['%.4f' % x for x in s['losses']]}")
    ok = (out["loss_rel_diff"] < 5e-2 and out["resume_rel_diff"] < 1e-3
          and out["into_fsdp2_rel_diff"] < 5e-2)
    print(f"loss rel diff {out['loss_rel_diff']:.2e}, grad norm rel diff "
          f"{out['grad_norm_rel_diff']:.2e}; resumed {out['resume_rel_diff']:.2e}, "
          f"into fsdp2 {out['into_fsdp2_rel_diff']:.2e}: {'ok' if ok else 'MISMATCH'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
