"""How much does automodel's pipeline parallelism cost over a hand-written pipelining loop?

Trains the same model on the same token sequences twice in one invocation, with the 1F1B
schedule on 2 pipeline stages (one per rank) and 8 micro-batches per step: once through
``automodel.api.run`` with ``pipeline=1f1b`` and once through ``baseline_loop`` below, which
splits the Hugging Face model into two stages by hand and drives
``torch.distributed.pipelining.Schedule1F1B`` directly. It prints the median step time of
both, their ratio (automodel / baseline) and both final losses as a sanity check. Then it
measures the receive-buffer memory of automodel's pipeline with and without
``pipeline.pp_recv_buffer_pool`` against the predicted ratio.

    python benchmarks/pipeline_baseline.py [--steps 30] [--hidden 128] [--json out.json]

As in ``compare_baseline.py``, the baseline reads the model config, optimizer settings, seed
and data from automodel's resolved config, and the learning rate is constant.
"""

from __future__ import annotations

# Only cheap imports here: the spawned ranks of both sides import this file again.
import argparse
import json
import os
import statistics
import sys
import tempfile

NPROC = 2  # pp=2, dp=1: one stage per rank


def build_overrides(args) -> list[str]:
    # automodel puts FSDP2 (on a 1-rank mesh) around each stage; force it to fp32 so that it
    # does the same arithmetic as the plain fp32 baseline.
    from compare_baseline import shared_overrides  # the sibling script; cheap to import

    return ["parallelism=fsdp2",
            "parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
            "param_dtype:float32,reduce_dtype:float32}",
            "pipeline=1f1b", f"pipeline.pp_microbatch_size={args.batch // args.microbatches}",
            ] + shared_overrides(args)


def baseline_spec(cfg, threads: int, n_micro: int) -> dict:
    """Everything the baseline ranks need, as plain values taken from automodel's ``cfg``."""
    from automodel.data.sources import token_sequences
    t, o = cfg.trainer, cfg.optim
    return {"threads": threads, "n_micro": n_micro, "model_config": dict(cfg.model.config),
            "seed": t.seed, "steps": t.max_steps, "batch": t.global_batch_size,
            "lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
            "max_grad_norm": o.max_grad_norm,
            "sequences": token_sequences(cfg.data_source, cfg.data, t.seq_len,
                                         cfg.model.config["vocab_size"])}


def make_stage_module(model, layers: range, first: bool, last: bool):
    """One pipeline stage of a Llama-style ``*ForCausalLM``: it keeps references to the
    modules it owns and repeats what ``LlamaModel.forward`` does around the decoder layers
    (positions, causal mask, rotary embeddings)."""
    import torch
    from torch import nn
    from transformers.masking_utils import create_causal_mask

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            inner = model.model
            self.config = inner.config
            self.embed = inner.embed_tokens if first else None
            self.layers = nn.ModuleList(inner.layers[i] for i in layers)
            self.rotary = inner.rotary_emb  # buffers only, needed on every stage
            self.norm = inner.norm if last else None
            self.lm_head = model.lm_head if last else None

        def forward(self, x):
            h = self.embed(x) if first else x  # token ids in on stage 0, hidden states after
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                      cache=None, position_ids=pos)
            rope = self.rotary(h, position_ids=pos)
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos,
                          use_cache=False)
            return self.lm_head(self.norm(h)) if last else h

    return Stage()


def baseline_rank(spec: dict) -> dict | None:
    """Entry point of one baseline rank (= one stage); rank 0 returns the measurements."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")  # rank, world size and address come from the launcher
    try:
        return baseline_loop(spec, dist.get_rank())
    finally:
        dist.destroy_process_group()


def baseline_loop(spec: dict, rank: int) -> dict | None:
    """The hand-written pipeline training loop of one rank."""
    import math
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.data.batches import BatchPlan

    torch.manual_seed(spec["seed"])  # same seed -> same initial weights as automodel
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec["model_config"]))
    half = len(model.model.layers) // NPROC  # 4 layers: 0-1 on rank 0, 2-3 on rank 1
    first, last = rank == 0, rank == NPROC - 1
    layers = range(rank * half, len(model.model.layers) if last else (rank + 1) * half)
    module = make_stage_module(model, layers, first, last)
    del model  # the stage holds what this rank trains

    stage = PipelineStage(module, rank, NPROC, torch.device("cpu"))

    # Per-micro-batch mean cross-entropy; scale_grads=True divides the gradients by the number
    # of (equal-sized) micro-batches, which gives automodel's sum / global-token-count.
    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    schedule = Schedule1F1B(stage, n_microbatches=spec["n_micro"], loss_fn=loss_fn,
                            scale_grads=True)
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=spec["lr"], betas=spec["betas"], eps=spec["eps"],
                            weight_decay=spec["weight_decay"])
    max_norm = spec["max_grad_norm"] if spec["max_grad_norm"] is not None else math.inf
    plan = BatchPlan(spec["sequences"], spec["batch"], spec["seed"])

    step_times = []
    for step in range(spec["steps"]):
        start = time.perf_counter()
        [(inputs, labels)] = plan.micro_batches(step, 0, 1, spec["batch"])  # whole batch
        losses: list = []
        if first:
            schedule.step(inputs)
        else:
            schedule.step(target=labels, losses=losses)
        # Global gradient norm: each rank holds different parameters, so sum the squares.
        sq = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        sq = (sq.to(torch.float64) ** 2).reshape(1)
        dist.all_reduce(sq)
        coef = min(1.0, max_norm / (sq.sqrt().item() + 1e-6))
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)

    # Outside the timed loop: the last step's mean loss (micro-batches are equal-sized, so
    # the mean of their means), known only on the last stage.
    final = torch.zeros(1, dtype=torch.float64)
    if losses:
        final += torch.stack([x.detach() for x in losses]).mean().to(torch.float64)
    dist.all_reduce(final)
    return {"step_times": step_times, "final_loss": float(final)} if rank == 0 else None


def run_baseline(spec: dict) -> dict:
    """Start the baseline ranks exactly the way automodel starts its own."""
    from automodel.launch.local import run_on_local_ranks

    return run_on_local_ranks(baseline_rank, NPROC, spec, name="pp-baseline")[0]


def measure_once(args, threads: int) -> tuple[dict, dict]:
    """One automodel run, then one baseline run: (automodel, baseline)."""
    from automodel.api import load_config, run

    overrides = build_overrides(args)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(overrides, output_dir=out)
        tokens_per_step = cfg.trainer.global_batch_size * cfg.trainer.seq_len
        records = run(overrides, output_dir=out)
    print(f"baseline: 1f1b, {NPROC} stages, {args.microbatches} micro-batches, "
          f"{cfg.trainer.max_steps} steps", flush=True)
    base = run_baseline(baseline_spec(cfg, threads, args.microbatches))
    # automodel logs every step; its step time is one step's tokens over its tokens/s.
    auto_times = [tokens_per_step / r["tokens_per_second"] for r in records
                  if r["step"] > args.warmup]
    return ({"step_time_s": statistics.median(auto_times), "final_loss": records[-1]["loss"]},
            {"step_time_s": statistics.median(base["step_times"][args.warmup:]),
             "final_loss": base["final_loss"]})


def compare(args, threads: int) -> dict:
    """Alternate the sides ``--repeats`` times; each side's fastest median counts."""
    runs = [measure_once(args, threads) for _ in range(args.repeats)]
    result = {}
    for i, side in enumerate(("automodel", "baseline")):
        medians = [r[i]["step_time_s"] for r in runs]
        result[side] = {"step_time_s": min(medians), "step_time_s_per_repeat": medians,
                        "final_loss": runs[-1][i]["final_loss"]}
    a, b = result["automodel"], result["baseline"]
    result.update(step_time_ratio=a["step_time_s"] / b["step_time_s"],
                  loss_abs_diff=abs(a["final_loss"] - b["final_loss"]))
    return result


def measure_recv_pool(args) -> dict:
    """Receive-buffer bytes of automodel's 1F1B pipeline without and with
    ``pipeline.pp_recv_buffer_pool``, against the predicted ratio: stage i keeps
    ring_i = min(m, pp - i + slack) buffer sets instead of m; the first stage only receives
    gradients, the last only activations (same shape), middle stages both."""
    from automodel.api import run
    from automodel.distributed.pipelining.buffer_pool import ring_size

    overrides = build_overrides(args) + ["trainer.max_steps=2"]
    measured = {}
    for pooled in (False, True):
        with tempfile.TemporaryDirectory() as out:
            records = run(overrides + [f"pipeline.pp_recv_buffer_pool={str(pooled).lower()}",
                                       f"pipeline.pp_recv_buffer_pool_slack={args.slack}"],
                          output_dir=out)
        measured[pooled] = records[-1]["pp_recv_buffer_bytes"]
    m, pp = args.microbatches, NPROC
    kinds = [1 if i in (0, pp - 1) else 2 for i in range(pp)]
    predicted = (sum(k * ring_size(pp, i, m, args.slack) for i, k in enumerate(kinds))
                 / sum(k * m for k in kinds))
    return {"bytes_unpooled": measured[False], "bytes_pooled": measured[True],
            "ratio": measured[True] / measured[False], "predicted_ratio": predicted}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per side, alternated; the fastest median counts")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="split evenly over the 2 stages")
    p.add_argument("--override", action="append", default=[],
                   help="extra Hydra override for automodel (repeatable); model/data/optim/"
                        "trainer values reach the baseline too, parallelism and pipeline "
                        "options do not")
    p.add_argument("--slack", type=int, default=2, help="pipeline.pp_recv_buffer_pool_slack")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = p.parse_args(argv)
    if args.steps <= args.warmup or args.repeats < 1:
        p.error("need --steps > --warmup and --repeats >= 1")
    if args.batch % args.microbatches or args.layers % NPROC:
        p.error(f"--batch must be a multiple of --microbatches, --layers of {NPROC}")

    # Same thread count on both sides, handed to automodel's ranks through its environment.
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // NPROC))
    os.environ["OMP_NUM_THREADS"] = os.environ["AUTOMODEL_NUM_THREADS"] = str(threads)

    import torch

    print(f"torch {torch.__version__}, {NPROC} ranks x {threads} thread(s), 1f1b", flush=True)
    result = compare(args, threads)
    print(f"\n{args.steps} steps ({args.warmup} warm-up left out of the medians), best of "
          f"{args.repeats} run(s) per side, batch {args.batch} in {args.microbatches} "
          f"micro-batches x seq {args.seq_len}, hidden {args.hidden}, {args.layers} layers, "
          f"pp={NPROC}; ratio is automodel / baseline")
    a, b = result["automodel"], result["baseline"]
    ok = result["loss_abs_diff"] <= 1e-3 * max(1.0, abs(b["final_loss"]))
    head = (f"{'schedule':<8} {'step ms auto':>12} {'step ms base':>12} {'time ratio':>10} "
            f"{'loss auto':>10} {'loss base':>10} {'loss ok':>7}")
    print(f"{head}\n{'-' * len(head)}")
    print(f"{'1f1b':<8} {a['step_time_s'] * 1e3:>12.1f} {b['step_time_s'] * 1e3:>12.1f} "
          f"{result['step_time_ratio']:>10.3f} {a['final_loss']:>10.5f} "
          f"{b['final_loss']:>10.5f} {'yes' if ok else 'NO':>7}")
    pool = measure_recv_pool(args)
    print(f"\nreceive buffers (all stages): {pool['bytes_unpooled'] / 1024:.0f} KiB unpooled, "
          f"{pool['bytes_pooled'] / 1024:.0f} KiB with pipeline.pp_recv_buffer_pool "
          f"(slack {args.slack}): ratio {pool['ratio']:.4f}, predicted "
          f"{pool['predicted_ratio']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "nproc": NPROC, "threads": threads,
                       "args": vars(args), "result": result, "recv_buffer_pool": pool},
                      f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
