"""Host memory while loading a pretrained model with FSDP2 on 1 and N local ranks.

Saves a model of the given size as a Hugging Face checkpoint (safetensors), then trains one
step on it with ``model=pretrained`` and FSDP2, twice for each rank count: as automodel does
it (meta-device build, rank 0 reads the checkpoint and broadcasts, each rank keeps its shards)
and the way it was done before (every rank loads the whole checkpoint, then shards it; the
``eager`` side, reproduced here by swapping the runner's model builder). Each rank reports the
peak of its resident memory above what it held after its imports; the node's peak is at most
their sum.

    python benchmarks/host_memory.py                       # ~270M parameters, 1 and 4 ranks
    python benchmarks/host_memory.py --ranks 1 2 --hidden 512 --layers 4 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FP32 = ("parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
        "param_dtype:float32,reduce_dtype:float32}")


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_entry(cfg, eager: bool):
    # imports are not weights: growth is measured after them
    import torch.distributed.fsdp  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    from automodel.recipes import train as runner

    if eager:  # before: every rank builds (loads) the whole model, then shards it
        def whole_model_everywhere(cfg, info):
            from automodel.models.builder import build_model

            return build_model(cfg.model, cfg.trainer.seed).to(info.device), None

        runner._initial_model = whole_model_everywhere
    start = _rss()
    runner.run_rank(cfg)
    return {"grown_bytes": _rss() - start}


def measure(ckpt: str, nproc: int, eager: bool) -> list[int]:
    from automodel.api import load_config
    from automodel.launch.local import run_on_local_ranks

    cfg = load_config(["parallelism=fsdp2", FP32, "model=pretrained",
                       f"model.pretrained_path={ckpt}", f"distributed.nproc_per_node={nproc}",
                       "trainer.max_steps=1", "trainer.global_batch_size=4",
                       "trainer.seq_len=32", "data=synthetic", "data.num_sequences=16",
                       "data.vocab_size=256"], output_dir=tempfile.mkdtemp())
    results = run_on_local_ranks(rank_entry, nproc, cfg, eager, name="hostmem")
    return [results[r]["grown_bytes"] for r in sorted(results)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.hidden * 3, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=True)
    ckpt = tempfile.mkdtemp(prefix="hostmem-ckpt-")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(ckpt)
    del model
    full = n_params * 4
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    print(f"model: {n_params / 1e6:.0f}M parameters, {full / 1e9:.2f} GB in fp32\n")
    print(f"{'ranks':>5}  {'side':<10} {'per-rank growth (GB)':<32} {'sum (GB)':>8} {'/full':>6}")
    for nproc in args.ranks:
        for eager in (True, False):
            grown = measure(ckpt, nproc, eager)
            side = "before" if eager else "automodel"
            per = " ".join(f"{g / 1e9:.2f}" for g in grown)
            print(f"{nproc:>5}  {side:<10} {per:<32} {sum(grown) / 1e9:>8.2f} "
                  f"{sum(grown) / full:>6.2f}")
            rows.append({"ranks": nproc, "side": side, "per_rank_bytes": grown,
                         "full_model_bytes": full})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
