"""How much does automodel cost over a hand-written PyTorch loop?

For each layout (DDP, FSDP2 and tensor parallel TP=2; 2 ranks each) this trains the same model
on the same token
sequences twice in one invocation: once through ``automodel.api.run`` and once through the
minimal loop in ``baseline_rank`` below. It prints the median step time and the peak memory
of both, their ratios (automodel / baseline) and both final losses as a sanity check.

    python benchmarks/compare_baseline.py [--steps 30] [--hidden 128] [--json out.json]

Every number the baseline uses (model config, optimizer settings, seed, data) is read from
automodel's own resolved config, so the two sides cannot drift apart. The learning rate is
held constant (no warmup, no decay) so the baseline needs no scheduler.
"""

from __future__ import annotations

# Only cheap imports at module level: the spawned ranks of both sides re-import this file,
# and anything imported here would count towards both sides' peak memory.
import argparse
import json
import os
import statistics
import sys
import tempfile

NPROC = 2
# The per-layout overrides. FSDP2 is forced to fp32 (automodel's default is bf16 params)
# so that it does the same arithmetic as the fp32 baseline.
LAYOUTS = {
    "ddp": ["parallelism=ddp"],
    "fsdp2": ["parallelism=fsdp2",
              "parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
              "param_dtype:float32,reduce_dtype:float32}"],
    # Tensor parallel over both ranks (dp = 1), the model's own Hugging Face plan.
    "tp2": ["parallelism=fsdp2", "mesh.tp_size=2",
            "parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
            "param_dtype:float32,reduce_dtype:float32}"],
}


# Model shapes (``--shapes``): Llama variants, untied embeddings, 8 heads unless narrower.
SHAPES = {
    "default": [],  # --hidden / --layers, llama_tiny's 256-token byte vocabulary
    "small_vocab": ["model.config.vocab_size=512", "model.config.hidden_size=256",
                    "model.config.intermediate_size=768", "model.config.num_hidden_layers=4",
                    "model.config.num_attention_heads=8", "model.config.num_key_value_heads=8"],
    "large_vocab": ["model.config.vocab_size=32000", "model.config.hidden_size=256",
                    "model.config.intermediate_size=768", "model.config.num_hidden_layers=4",
                    "model.config.num_attention_heads=8", "model.config.num_key_value_heads=8"],
    "deep_narrow": ["model.config.vocab_size=4096", "model.config.hidden_size=128",
                    "model.config.intermediate_size=384", "model.config.num_hidden_layers=16",
                    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4"],
    "wide_shallow": ["model.config.vocab_size=4096", "model.config.hidden_size=1024",
                     "model.config.intermediate_size=2816", "model.config.num_hidden_layers=2",
                     "model.config.num_attention_heads=8", "model.config.num_key_value_heads=8"],
}
UNTIED = ["model.config.tie_word_embeddings=false"]


def shared_overrides(args) -> list[str]:
    """Data, trainer, optimizer and model overrides both benchmark scripts use."""
    return [
        "data=synthetic", f"data.num_sequences={max(args.batch * args.steps, 256)}",
        f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
        f"trainer.seq_len={args.seq_len}", "trainer.log_every=1",
        "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",  # constant learning rate
        f"model.config.hidden_size={args.hidden}",
        f"model.config.intermediate_size={args.hidden * 11 // 4}",  # llama_tiny's ratio
        f"model.config.num_hidden_layers={args.layers}",
        f"distributed.nproc_per_node={NPROC}",
    ] + (SHAPES[args.shape] + UNTIED if getattr(args, "shape", "default") != "default"
         else []) + list(args.override)


def build_overrides(layout: str, args) -> list[str]:
    """Hydra overrides shared by both sides, plus the layout's own."""
    return LAYOUTS[layout] + shared_overrides(args)


def baseline_spec(layout: str, cfg, threads: int) -> dict:
    """Plain values (and the token tensor) the baseline ranks need, taken from ``cfg``."""
    from automodel.data.sources import token_sequences

    t, o = cfg.trainer, cfg.optim
    sequences = token_sequences(cfg.data_source, cfg.data, t.seq_len,
                                cfg.model.config["vocab_size"])
    return {"layout": layout, "threads": threads, "model_config": dict(cfg.model.config),
            "seed": t.seed, "steps": t.max_steps, "batch": t.global_batch_size,
            "lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
            "max_grad_norm": o.max_grad_norm, "sequences": sequences,
            "profile_steps": t.profile_steps}


def baseline_rank(spec: dict) -> dict | None:
    """Entry point of one baseline rank. Rank 0 returns its measurements."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")  # rank, world size and address come from the launcher
    try:
        # The model lives only inside baseline_loop: a DDP model still alive when the
        # process group is destroyed hangs the rank at exit (in the gloo destructor).
        result = baseline_loop(spec, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()
    return result


def baseline_loop(spec: dict, rank: int, world: int) -> dict | None:
    """The hand-written training loop."""
    import math
    import resource
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.data.batches import BatchPlan

    torch.manual_seed(spec["seed"])  # same seed -> same initial weights as automodel
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec["model_config"]))
    data_rank, data_world = rank, world
    if spec["layout"] == "ddp":
        model = DistributedDataParallel(model)
    elif spec["layout"] == "tp2":  # Megatron-style TP with a hand-written plan
        parallelize_by_hand(model)
        data_rank, data_world = 0, 1  # both ranks see the whole batch
    else:  # FSDP2: one unit per decoder layer, then the root (fp32, torch's defaults)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=spec["betas"],
                            eps=spec["eps"], weight_decay=spec["weight_decay"])
    max_norm = spec["max_grad_norm"] if spec["max_grad_norm"] is not None else math.inf
    plan = BatchPlan(spec["sequences"], spec["batch"], spec["seed"])

    from torch.profiler import record_function

    from automodel.tracking.profile import StepProfiler

    # (the same labels as automodel's step, for --profile; free when not profiling)
    profiler = StepProfiler(spec["profile_steps"], spec.get("profile_dir", "."), rank, False)
    step_times = []
    for step in range(spec["steps"]):
        profiler.begin(step + 1)
        start = time.perf_counter()
        [(inputs, labels)] = plan.micro_batches(step, data_rank, data_world,
                                                spec["batch"] // data_world)
        with record_function("automodel::forward"):
            logits = model(input_ids=inputs, use_cache=False).logits
        with record_function("automodel::loss"):
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        with record_function("automodel::backward"):
            loss.backward()  # DDP / FSDP2 average the gradients over the ranks
        with record_function("automodel::clip"):
            clip_mixed(model, max_norm)
        with record_function("automodel::optimizer"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        profiler.end(step + 1)

    # Outside the timed loop: the last step's loss over all ranks, and the peak RSS.
    final = loss.detach().to(torch.float64)
    dist.all_reduce(final)  # gloo has no AVG; every rank has the same token count (TP: same loss)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0],
                        dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    return {"step_times": step_times, "final_loss": float(final) / world,
            "peak_memory_bytes": int(peak.item())}


def parallelize_by_hand(model) -> None:
    """The textbook Llama TP plan, written out with parallelize_module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (NPROC,))
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def clip_mixed(model, max_norm: float) -> None:
    """clip_grad_norm_ for a mix of DTensor (TP-sharded) and plain gradients."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    dtensors = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if not dtensors:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    total = torch.nn.utils.get_total_norm(dtensors).full_tensor() ** 2
    if plain:
        total = total + torch.nn.utils.get_total_norm(plain) ** 2
    coef = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0).item()
    for group in (dtensors, plain):
        if group:
            torch._foreach_mul_(group, coef)


def run_baseline(spec: dict) -> dict:
    """Start the baseline ranks exactly the way automodel starts its own."""
    from automodel.launch.local import run_on_local_ranks

    return run_on_local_ranks(baseline_rank, NPROC, spec, name="baseline")[0]


def measure_once(layout: str, args, threads: int) -> tuple[dict, dict]:
    """One automodel run and one baseline run: (automodel, baseline) measurements."""
    from automodel.api import load_config, run

    overrides = build_overrides(layout, args)
    if args.profile:
        overrides.append(f"trainer.profile_steps=[{args.profile[0]},{args.profile[1]}]")
    profiles = {}
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(overrides, output_dir=out)
        tokens_per_step = cfg.trainer.global_batch_size * cfg.trainer.seq_len
        records = run(overrides, output_dir=out)
        if args.profile:
            profiles["automodel"] = _read_breakdown(out)
    print(f"baseline: {layout} on {NPROC} rank(s), {cfg.trainer.max_steps} steps", flush=True)
    with tempfile.TemporaryDirectory() as out:
        base = run_baseline({**baseline_spec(layout, cfg, threads), "profile_dir": out})
        if args.profile:
            profiles["baseline"] = _read_breakdown(out)

    # automodel logs every step: its step time is the tokens of one step over its tokens/s.
    auto_times = [tokens_per_step / r["tokens_per_second"] for r in records
                  if r["step"] > args.warmup]
    auto = {"step_time_s": statistics.median(auto_times), "final_loss": records[-1]["loss"],
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records)}
    baseline = {"step_time_s": statistics.median(base["step_times"][args.warmup:]),
                "final_loss": base["final_loss"],
                "peak_memory_bytes": base["peak_memory_bytes"]}
    for side, values in ((auto, profiles.get("automodel")), (baseline, profiles.get("baseline"))):
        if values is not None:
            side["profile_seconds_per_step"] = values
    return auto, baseline


def _read_breakdown(out: str) -> dict:
    with open(os.path.join(out, "profile", "breakdown_rank0.json")) as f:
        return json.load(f)["seconds_per_step"]


def compare(layout: str, args, threads: int) -> dict:
    """Alternate the two sides ``--repeats`` times; keep each side's fastest median (the one
    least disturbed by other work on the machine) and its largest peak."""
    runs = [measure_once(layout, args, threads) for _ in range(args.repeats)]
    result = {}
    for i, side in enumerate(("automodel", "baseline")):
        medians = [r[i]["step_time_s"] for r in runs]
        result[side] = {"step_time_s": min(medians), "step_time_s_per_repeat": medians,
                        "final_loss": runs[-1][i]["final_loss"],
                        "peak_memory_bytes": max(r[i]["peak_memory_bytes"] for r in runs)}
        if "profile_seconds_per_step" in runs[-1][i]:
            result[side]["profile_seconds_per_step"] = runs[-1][i]["profile_seconds_per_step"]
    auto, baseline = result["automodel"], result["baseline"]
    result.update(step_time_ratio=auto["step_time_s"] / baseline["step_time_s"],
                  peak_memory_ratio=auto["peak_memory_bytes"] / baseline["peak_memory_bytes"],
                  loss_abs_diff=abs(auto["final_loss"] - baseline["final_loss"]))
    return result


def print_table(results: dict) -> None:
    mib = 2.0 ** 20
    head = (f"{'layout':<7} {'step ms auto':>12} {'step ms base':>12} {'time ratio':>10} "
            f"{'peak MiB auto':>13} {'peak MiB base':>13} {'mem ratio':>9} "
            f"{'loss auto':>10} {'loss base':>10} {'loss ok':>7}")
    print(head)
    print("-" * len(head))
    for layout, r in results.items():
        a, b = r["automodel"], r["baseline"]
        ok = r["loss_abs_diff"] <= 1e-3 * max(1.0, abs(b["final_loss"]))
        print(f"{layout:<7} {a['step_time_s'] * 1e3:>12.1f} {b['step_time_s'] * 1e3:>12.1f} "
              f"{r['step_time_ratio']:>10.3f} {a['peak_memory_bytes'] / mib:>13.1f} "
              f"{b['peak_memory_bytes'] / mib:>13.1f} {r['peak_memory_ratio']:>9.3f} "
              f"{a['final_loss']:>10.5f} {b['final_loss']:>10.5f} {'yes' if ok else 'NO':>7}")


def print_profiles(results: dict) -> None:
    """Seconds per step of each phase, both sides, from the last repeat's profiled steps."""
    for name, r in results.items():
        a = r["automodel"].get("profile_seconds_per_step")
        b = r["baseline"].get("profile_seconds_per_step")
        if a is None or b is None:
            continue
        print(f"\nwhere the step goes, {name} (ms per step, rank 0; the phases include the "
              "collectives inside them)")
        print(f"{'phase':<32} {'automodel':>10} {'baseline':>10} {'diff':>8}")
        for key in a:
            print(f"{key:<32} {a[key] * 1e3:>10.1f} {b[key] * 1e3:>10.1f} "
                  f"{(a[key] - b[key]) * 1e3:>+8.1f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS),
                   default=["ddp", "fsdp2", "tp2"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per side, alternated; the fastest median counts")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--override", action="append", default=[],
                   help="extra Hydra override for automodel (repeatable); model/data/optim/"
                        "trainer values reach the baseline too, parallelism options do not")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["default"],
                   help="model shapes (untied embeddings); default: --hidden/--layers")
    p.add_argument("--profile", nargs=2, type=int, metavar=("FIRST", "LAST"),
                   help="profile these steps on both sides (trainer.profile_steps) and print "
                        "where the step time goes")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = p.parse_args(argv)
    if args.steps <= args.warmup or args.repeats < 1:
        p.error("need --steps > --warmup and --repeats >= 1")

    # One thread count for both sides: what automodel's launcher would choose (or the
    # caller's OMP_NUM_THREADS), handed to automodel's ranks through its environment.
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // NPROC))
    os.environ["OMP_NUM_THREADS"] = os.environ["AUTOMODEL_NUM_THREADS"] = str(threads)

    import torch

    print(f"torch {torch.__version__}, {NPROC} ranks x {threads} thread(s), layouts: "
          f"{', '.join(args.layouts)}", flush=True)
    results = {}
    for shape in args.shapes:
        args.shape = shape
        for layout in args.layouts:
            name = layout if shape == "default" else f"{shape}/{layout}"
            results[name] = compare(layout, args, threads)
    print(f"\n{args.steps} steps ({args.warmup} warm-up left out of the medians), "
          f"best of {args.repeats} run(s) per side, batch "
          f"{args.batch} x seq {args.seq_len}, hidden {args.hidden}, {args.layers} layers, "
          f"torch {torch.__version__}; ratios are automodel / baseline")
    print_table(results)
    if args.profile:
        print_profiles(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "nproc": NPROC, "threads": threads,
                       "args": vars(args), "results": results}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
