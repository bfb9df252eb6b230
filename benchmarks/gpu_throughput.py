"""automodel against a hand-written training loop on ONE GPU: tokens/s, MFU and peak memory.

For each layout it trains the same Llama (built from config, ~1B parameters by default) on the
same synthetic token sequences twice in this one process: first through
``automodel.api.run`` with ``distributed.nproc_per_node=1`` (the rank runs in-process), then
through the minimal loop in ``hand_written`` below. Layouts (world size 1 throughout):

* ``fsdp2``: FSDP2 on a 1-rank mesh with automodel's default mixed precision (bf16
  parameters, fp32 gradient reduction) vs ``fully_shard`` per decoder layer and the root with
  the same ``MixedPrecisionPolicy``;
* ``fsdp2_compile``: the same plus ``parallelism.enable_compile=true`` vs the hand-written
  loop calling ``module.compile()`` on each decoder layer before ``fully_shard``;
* ``none_autocast``: ``parallelism=none parallelism.autocast_dtype=bfloat16`` vs a plain loop
  whose forward runs under ``torch.autocast(dtype=torch.bfloat16)``.

    python benchmarks/gpu_throughput.py [--layouts fsdp2 ...] [--steps 25] [--json out.json]
    python benchmarks/gpu_throughput.py --device cpu --hidden 64 --layers 2 --heads 4 \\
        --vocab 256 --seq 64 --batch 2 --steps 4 --warmup 1     # smoke test of the code paths

Both sides: fp32 master weights, AdamW, gradient clipping at 1.0, a constant learning rate,
the same seed (same initial weights), the same batches (automodel's ``BatchPlan`` over its
synthetic sequences) and the same number of steps. Tokens/s is the median over the steps
after ``--warmup``; MFU = model FLOPs per token x tokens/s / ``--peak-tflops``, with FLOPs per
token = 6 x N (parameters without the input embedding; the LM head counts) + 12 x layers x
hidden x seq (attention scores and values, forward and backward). Only torch APIs that
torch 2.11 has are used.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time

# Per-layout automodel overrides, and what the hand-written loop does for the layout.
LAYOUTS = {
    "fsdp2": {"overrides": ["parallelism=fsdp2"], "fsdp2": True, "compile": False},
    "fsdp2_compile": {"overrides": ["parallelism=fsdp2", "parallelism.enable_compile=true"],
                      "fsdp2": True, "compile": True},
    "none_autocast": {"overrides": ["parallelism=none", "parallelism.autocast_dtype=bfloat16"],
                      "fsdp2": False, "compile": False},
}
GOAL = 0.98  # automodel tokens/s >= GOAL x the hand-written loop's


def build_overrides(layout: str, args) -> list[str]:
    """automodel's Hydra overrides: the layout's, the model, the data, the trainer."""
    intermediate = args.intermediate or args.hidden * 11 // 4  # 5632 at hidden 2048
    overrides = LAYOUTS[layout]["overrides"] + [
        "data=synthetic", f"data.num_sequences={max(args.batch * args.steps, 64)}",
        f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
        f"trainer.seq_len={args.seq}", "trainer.log_every=1",
        "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",  # constant learning rate
        f"optim.max_grad_norm={args.clip}",
        f"model.config.vocab_size={args.vocab}",
        f"model.config.hidden_size={args.hidden}",
        f"model.config.intermediate_size={intermediate}",
        f"model.config.num_hidden_layers={args.layers}",
        f"model.config.num_attention_heads={args.heads}",
        f"model.config.num_key_value_heads={args.kv_heads or args.heads}",
        f"model.config.max_position_embeddings={max(args.seq, 256)}",
        "model.dtype=float32",  # fp32 master weights on both sides
        "distributed.nproc_per_node=1",  # one rank, run in this process
    ]
    if args.device == "cpu":
        overrides.append("distributed.backend=gloo")  # automodel's device: CPU even with CUDA
    return overrides + list(args.override)


def hand_written_spec(layout: str, cfg) -> dict:
    """Plain values the hand-written loop needs, read from automodel's resolved config."""
    from automodel.data.sources import token_sequences

    t, o = cfg.trainer, cfg.optim
    return {"layout": layout, "model_config": dict(cfg.model.config), "seed": t.seed,
            "steps": t.max_steps, "batch": t.global_batch_size, "seq": t.seq_len,
            "lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
            "max_grad_norm": o.max_grad_norm,
            "sequences": token_sequences(cfg.data_source, cfg.data, t.seq_len,
                                         cfg.model.config["vocab_size"])}


def hand_written(spec: dict, device) -> dict:
    """The hand-written training loop; returns tokens/s per step, the final loss and the
    peak memory."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.data.batches import BatchPlan

    layout = LAYOUTS[spec["layout"]]
    cuda = device.type == "cuda"
    torch.manual_seed(spec["seed"])  # same seed -> same initial weights as automodel
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec["model_config"]),
                                             dtype=torch.float32)
    model.config.use_cache = False
    model.to(device)
    own_group = False
    if layout["fsdp2"]:
        if not dist.is_initialized():  # automodel destroyed its group when it finished
            extra = {"device_id": device} if cuda else {}
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1, **extra)
            own_group = True
        mesh = init_device_mesh(device.type, (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            if layout["compile"]:
                layer.compile()  # in place, before sharding, as automodel does
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    elif layout["compile"]:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=spec["betas"],
                            eps=spec["eps"], weight_decay=spec["weight_decay"])
    plan = BatchPlan(spec["sequences"], spec["batch"], spec["seed"])
    autocast = spec["layout"] == "none_autocast"

    def to_device(t):
        return t.pin_memory().to(device, non_blocking=True) if cuda else t

    tokens_per_step = spec["batch"] * spec["seq"]
    rates = []
    if cuda:
        torch.cuda.synchronize(device)
    last = time.perf_counter()
    for step in range(spec["steps"]):
        [(inputs, labels)] = plan.micro_batches(step, 0, 1, spec["batch"])
        inputs, labels = to_device(inputs), to_device(labels)
        ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if autocast
               else contextlib.nullcontext())
        with ctx:
            logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        if spec["max_grad_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        final_loss = loss.item()  # the step's one host read: waits for the device
        now = time.perf_counter()
        rates.append(tokens_per_step / (now - last))
        last = now
    peak = peak_memory_bytes(device)
    del model, opt, logits, loss
    if own_group:
        dist.destroy_process_group()
    return {"tokens_per_second": rates, "final_loss": final_loss, "peak_memory_bytes": peak}


def peak_memory_bytes(device) -> int:
    """The CUDA allocator's peak; on CPU the process's peak resident set (as automodel)."""
    import resource

    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def clean_slate(device, reset_compiler: bool) -> None:
    """Between sides: free what the last one left, forget compiled code (each side compiles
    cold) and restart the peak-memory counter."""
    import torch

    gc.collect()
    if reset_compiler:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def flops_per_token(model_config: dict, seq: int) -> tuple[float, int]:
    """(model FLOPs per trained token, N): 6 N + 12 x layers x hidden x seq, with N the
    parameters without the input embedding (a tied LM head still counts once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**model_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight
    n = sum(p.numel() for p in model.parameters()) - embed.numel()
    head = model.get_output_embeddings()
    if head is not None and head.weight is embed:
        n += embed.numel()
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return 6.0 * n + 12.0 * layers * hidden * seq, n


def side_summary(rates: list[float], warmup: int, peak: int, final_loss: float,
                 flops: float, peak_tflops: float) -> dict:
    tps = statistics.median(rates[warmup:])
    return {"tokens_per_second": tps, "mfu": flops * tps / (peak_tflops * 1e12),
            "peak_memory_bytes": peak, "final_loss": final_loss,
            "tokens_per_second_per_step": rates}


def measure(layout: str, args, device) -> dict:
    """automodel first, then the hand-written loop, in this process."""
    from automodel.api import load_config, run

    overrides = build_overrides(layout, args)
    compiles = LAYOUTS[layout]["compile"]
    print(f"\n=== {layout}: automodel", flush=True)
    clean_slate(device, compiles)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(overrides, output_dir=out)
        records = run(overrides, output_dir=out)
    # the last optimizer step's allocations (the run restarts the allocator's peak at each
    # step's read, keeping the largest in the records)
    after_run = max(peak_memory_bytes(device), max(r["peak_memory_bytes"] for r in records))
    spec = hand_written_spec(layout, cfg)
    flops, n = flops_per_token(spec["model_config"], spec["seq"])
    rates = [r["tokens_per_second"] for r in sorted(records, key=lambda r: r["step"])]
    auto = side_summary(rates, args.warmup, max(r["peak_memory_bytes"] for r in records),
                        records[-1]["loss"], flops, args.peak_tflops)
    auto["peak_memory_bytes_after_run"] = after_run
    del records
    print(f"=== {layout}: hand-written loop", flush=True)
    clean_slate(device, compiles)
    base = hand_written(spec, device)
    clean_slate(device, compiles)
    hand = side_summary(base["tokens_per_second"], args.warmup, base["peak_memory_bytes"],
                        base["final_loss"], flops, args.peak_tflops)
    ratio = auto["tokens_per_second"] / hand["tokens_per_second"]
    return {"automodel": auto, "hand_written": hand, "tokens_per_second_ratio": ratio,
            "peak_memory_ratio": auto["peak_memory_bytes"] / hand["peak_memory_bytes"],
            "meets_goal": ratio >= GOAL, "flops_per_token": flops, "n_params_flops": n}


def print_table(results: dict) -> None:
    gb = 1e9
    head = (f"{'layout':<14} {'tok/s auto':>11} {'tok/s hand':>11} {'ratio':>6} "
            f"{'MFU auto':>8} {'MFU hand':>8} {'peak GB auto':>12} {'peak GB hand':>12} "
            f"{'loss auto':>9} {'loss hand':>9} {'>=' + str(GOAL):>6}")
    print(head)
    print("-" * len(head))
    for layout, r in results.items():
        a, h = r["automodel"], r["hand_written"]
        print(f"{layout:<14} {a['tokens_per_second']:>11.0f} {h['tokens_per_second']:>11.0f} "
              f"{r['tokens_per_second_ratio']:>6.3f} {a['mfu']:>8.1%} {h['mfu']:>8.1%} "
              f"{a['peak_memory_bytes'] / gb:>12.2f} {h['peak_memory_bytes'] / gb:>12.2f} "
              f"{a['final_loss']:>9.4f} {h['final_loss']:>9.4f} "
              f"{'yes' if r['meets_goal'] else 'NO':>6}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS),
                   help="default: all three on cuda; fsdp2 and none_autocast on cpu "
                        "(a cold compile takes long there)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--intermediate", type=int, default=None, help="default: hidden * 11 / 4")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="peak dense bf16 TFLOP/s for MFU (989: H100/H200 SXM)")
    p.add_argument("--override", action="append", default=[],
                   help="extra Hydra override for automodel (repeatable); model/optim/trainer "
                        "values reach the hand-written loop too, parallelism options do not")
    p.add_argument("--json", metavar="PATH", help="also write every number here")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("need --steps > --warmup")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: use --device cpu (with small sizes) for a smoke test")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    layouts = args.layouts or (list(LAYOUTS) if args.device == "cuda"
                               else ["fsdp2", "none_autocast"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {name}; layouts: {', '.join(layouts)}", flush=True)

    results = {layout: measure(layout, args, device) for layout in layouts}
    first = next(iter(results.values()))
    print(f"\n{args.steps} steps, median tokens/s of steps {args.warmup + 1}-{args.steps}; "
          f"batch {args.batch} x seq {args.seq}, hidden {args.hidden}, {args.layers} layers, "
          f"{first['n_params_flops'] / 1e9:.3g}B parameters without the input embedding, "
          f"{first['flops_per_token'] / 1e9:.3g} GFLOP/token; MFU against "
          f"{args.peak_tflops:g} TFLOP/s; ratio = automodel / hand-written (goal >= {GOAL})")
    print_table(results)
    if device.type == "cpu":
        print("(on CPU the peak is the process's resident set: both sides share one process, "
              "so the hand-written number includes automodel's)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": name, "args": vars(args),
                       "goal": GOAL, "results": results}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
