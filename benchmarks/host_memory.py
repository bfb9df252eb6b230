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
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import reset_peak as _reset_peak  # noqa: E402
from benchmarks.common import status as _status  # noqa: E402

FP32 = ("parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
        "param_dtype:float32,reduce_dtype:float32}")


def rank_entry(cfg, eager: bool):
    # imports are not weights: growth is measured after them
    import torch.distributed.fsdp  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    from automodel.recipes import components
    from automodel.recipes import train as runner

    if eager:  # before: every rank builds (loads) the whole model, then shards it
        def whole_model_everywhere(cfg, info, group=None):
            from automodel.models.builder import build_model

            return build_model(cfg.model, cfg.trainer.seed).to(info.device), None

        components.initial_model = whole_model_everywhere
    loaded = {}
    parallelize = components.parallelize

    def parallelize_and_measure(*args, **kwargs):  # the model is loaded and sharded after it
        parts = parallelize(*args, **kwargs)
        loaded["peak"] = _status("VmHWM") - start
        loaded["anon"] = _status("RssAnon") - anon
        return parts

    components.parallelize = parallelize_and_measure
    _reset_peak()
    start, anon = _status("VmRSS"), _status("RssAnon")
    runner.run_rank(cfg)
    return {"loaded_bytes": loaded["peak"], "loaded_anon_bytes": loaded["anon"],
            "step_bytes": _status("VmHWM") - start}


def measure(ckpt: str, nproc: int, eager: bool) -> list[int]:
    from automodel.api import load_config
    from automodel.launch.local import run_on_local_ranks

    cfg = load_config(["parallelism=fsdp2", FP32, "model=pretrained",
                       f"model.pretrained_path={ckpt}", f"distributed.nproc_per_node={nproc}",
                       "trainer.max_steps=1", "trainer.global_batch_size=4",
                       "trainer.seq_len=32", "data=synthetic", "data.num_sequences=16",
                       "data.vocab_size=256"], output_dir=tempfile.mkdtemp())
    results = run_on_local_ranks(rank_entry, nproc, cfg, eager, name="hostmem")
    return [results[r] for r in sorted(results)]


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
    print("per rank, after its imports: peak resident memory growth through loading and "
          "sharding the model (loaded; file pages of the checkpoint included), the anonymous "
          "memory it then holds (anon: weights copied out of the file), and the peak growth "
          "through one training step (step)")
    print(f"{'ranks':>5}  {'side':<10} {'loaded per rank (GB)':<28} {'sum':>6} {'/full':>6}"
          f"  {'anon sum':>8}  {'step sum':>8}")
    for nproc in args.ranks:
        for eager in (True, False):
            ranks = measure(ckpt, nproc, eager)
            side = "before" if eager else "automodel"
            loaded = [r["loaded_bytes"] for r in ranks]
            step = sum(r["step_bytes"] for r in ranks)
            anon = sum(r["loaded_anon_bytes"] for r in ranks)
            per = " ".join(f"{g / 1e9:.2f}" for g in loaded)
            print(f"{nproc:>5}  {side:<10} {per:<28} {sum(loaded) / 1e9:>6.2f} "
                  f"{sum(loaded) / full:>6.2f}  {anon / 1e9:>8.2f}  {step / 1e9:>8.2f}")
            rows.append({"ranks": nproc, "side": side, "per_rank": ranks,
                         "full_model_bytes": full})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
