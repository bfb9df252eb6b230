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

5. ``megatron_fsdp`` with ``calculate_per_token_loss=true`` (the library sums gradients; the
   step's loss scale follows): its losses and grad norms must repeat run 2's;
6. ``megatron_fsdp`` with ``activation_checkpointing=true`` (each block's MLP): the same
   losses as run 2, and less peak memory;
7. ``megatron_fsdp`` with ``init_fsdp_with_meta_device=true``: the model reaches the wrap on
   the meta device and the library fills it one module at a time; the same initial weights,
   so the same losses as run 2;
8. a small model with tied embeddings, with and without ``init_fsdp_with_meta_device``: the
   same losses (the tie survives the per-module initialization).

Tensor parallelism with megatron_fsdp is refused before launch (``mesh.tp_size`` > 1): the
first thing checked, on any machine. One GPU cannot run TP (nor show the per-token sum over
several ranks: at world size 1 both modes divide by 1); the CPU tests check the loss scale
against the library's own reduction code.

Printed: per-step losses and gradient norms of runs 1 and 2 with their largest relative
difference (bf16: expect about 1e-2), tokens/s (median after the warmup) and peak GPU memory,
and whether runs 3-8 match as they should. Exit status 1 if something fails.
``--dry-run`` (any machine, no GPU): build and validate every run's configuration and check
the TP refusal, without training.
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


RUNS = {  # name: (strategy, extra overrides), besides the checkpoint/resume runs
    "fsdp2": ("fsdp2", []),
    "megatron_fsdp": ("megatron_fsdp", []),
    "per_token": ("megatron_fsdp", ["parallelism.calculate_per_token_loss=true"]),
    "mlp_checkpointing": ("megatron_fsdp", ["parallelism.activation_checkpointing=true"]),
    "meta_init": ("megatron_fsdp", ["parallelism.init_fsdp_with_meta_device=true"]),
}
TIED = ["model.config.tie_word_embeddings=true"]
SAME = 1e-3  # runs 3 and 5-8 repeat run 2's arithmetic (up to kernel order)


def small(args):
    """The tied-embedding pair's model: small, so the pair costs little."""
    return argparse.Namespace(**{**vars(args), "hidden": 256, "layers": 2, "heads": 4,
                                 "vocab": 1024, "seq": 256})


def check_tp_refused(args, root: Path) -> str:
    """The TP refusal, before launch: the message (raises if it is not refused)."""
    from automodel.api import load_config
    from automodel.config.build import ConfigError

    try:
        load_config(overrides(args, "megatron_fsdp", "mesh.tp_size=2",
                              "distributed.nproc_per_node=2", "distributed.backend=gloo"),
                    str(root / "tp"))
    except ConfigError as err:
        if "mesh.tp_size=2" not in str(err):
            raise
        return str(err)
    raise AssertionError("parallelism=megatron_fsdp with mesh.tp_size=2 was not refused")


def dry_run(args, root: Path) -> dict:
    """Every run's configuration, validated (no training): {name: resolved parallelism}."""
    from automodel.api import load_config

    out = {name: load_config(overrides(args, strategy, *extra), str(root / name)).parallelism
           for name, (strategy, extra) in RUNS.items()}
    for meta in (False, True):
        flag = f"parallelism.init_fsdp_with_meta_device={str(meta).lower()}"
        out[f"tied_meta_{meta}"] = load_config(
            overrides(small(args), "megatron_fsdp", *TIED, flag), str(root / "tied")).parallelism
    return out


def summary(records, warmup: int) -> dict:
    return {"tokens_per_second": statistics.median(r["tokens_per_second"]
                                                   for r in records[warmup:]),
            "peak_gb": max(r.get("peak_memory_bytes", 0) for r in records) / 1e9,
            "losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records]}


def rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def same(out: dict, name: str, got: dict, want: dict) -> bool:
    """Record ``name``'s largest relative difference (losses and grad norms) from ``want``."""
    out[f"{name}_rel_diff"] = max(rel(got["losses"], want["losses"]),
                                  rel(got["grad_norms"], want["grad_norms"]))
    return out[f"{name}_rel_diff"] < SAME


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
    p.add_argument("--dry-run", action="store_true",
                   help="validate every run's configuration and the TP refusal; no training")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="mfsdp-"))
    half = args.steps // 2
    ckpt = [f"checkpoint.every_steps={half}"]
    out: dict = {"tp_refused": check_tp_refused(args, root)}
    print(f"TP refused before launch: {out['tp_refused']}")
    if args.dry_run:
        print(f"configurations valid: {', '.join(dry_run(args, root))}")
        return 0
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
    ok = (out["loss_rel_diff"] < 5e-2 and out["resume_rel_diff"] < SAME
          and out["into_fsdp2_rel_diff"] < 5e-2)
    for name in ("per_token", "mlp_checkpointing", "meta_init"):
        strategy, extra = RUNS[name]
        out[name] = summary(run(overrides(args, strategy, *extra), output_dir=str(root / name)),
                            args.warmup)
        ok &= same(out, name, out[name], out["megatron_fsdp"])
    ok &= out["mlp_checkpointing"]["peak_gb"] < out["megatron_fsdp"]["peak_gb"]
    tied = [summary(run(overrides(small(args), "megatron_fsdp", *TIED,
                                  f"parallelism.init_fsdp_with_meta_device={meta}"),
                        output_dir=str(root / f"tied_{meta}")), 0)
            for meta in ("false", "true")]
    ok &= same(out, "tied_meta_init", tied[1], tied[0])
    for name in ("fsdp2", "megatron_fsdp", "per_token", "mlp_checkpointing", "meta_init"):
        s = out[name]
        print(f"{name:17s} {s['tokens_per_second']:9.0f} tok/s  peak {s['peak_gb']:6.2f} GB  "
              f"losses {['%.4f' % x for x in s['losses']]}")
    print(f"loss rel diff {out['loss_rel_diff']:.2e}, grad norm rel diff "
          f"{out['grad_norm_rel_diff']:.2e}; resumed {out['resume_rel_diff']:.2e}, "
          f"into fsdp2 {out['into_fsdp2_rel_diff']:.2e}; "
          + ", ".join(f"{k} {out[k + '_rel_diff']:.2e}" for k in
                      ("per_token", "mlp_checkpointing", "meta_init", "tied_meta_init"))
          + f": {'ok' if ok else 'MISMATCH'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
