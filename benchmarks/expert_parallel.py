"""Expert parallelism on CPU: expert memory per rank, all-to-all volume, throughput.

Trains the same job (a tiny mixture-of-experts model built from config, made bigger so that
its experts dominate the parameters) with ``mesh.ep_size`` 1, 2 and 4 on the same ``dp``
ranks (default 4: FSDP2 in fp32, ``mesh.dp_size=4`` in every run), so every run processes the
same tokens per rank and per step and must report the same losses. The dp ranks of the stage
are regrouped as ``ep_shard x ep``:

* ep 1: no expert parallelism; every layer's experts belong to its decoder block's FSDP2
  unit, sharded over all ``dp`` ranks and all-gathered whole (all ``N`` experts) for compute;
* ep 2 (``dp`` 4): 2 groups of ``N / 2`` experts, each FSDP2-sharded over ``ep_shard`` 2;
* ep 4 (``dp`` 4): 4 groups of ``N / 4`` experts, ``ep_shard`` 1 (nothing to shard).

    python benchmarks/expert_parallel.py                     # ep 1 2 4 on 4 ranks, ~2 min
    python benchmarks/expert_parallel.py --experts 32 --moe-intermediate 512 --json ep.json
    python benchmarks/expert_parallel.py --seq 64 --steps 3 --warmup 1   # a quick check

Notation: ``N`` experts per layer, ``k`` experts per token, ``L`` MoE layers, ``E`` hidden,
``I`` an expert's intermediate size, ``b`` bytes per element (4: fp32), ``T`` tokens per rank
per step (global batch x seq / dp).

Expert parameters (bytes). An expert is ``gate_up_proj [2I, E]`` and ``down_proj [E, I]``
(the fused 3-D weights of qwen3_moe, olmoe and mixtral alike): ``P = 3 E I b``.

* sharded (what a rank stores between steps; its optimizer state is twice that again)::

      sharded = L * N * P / (ep * ep_shard)        = L * N * P / dp: the same for every ep

  measured: the local shards (``DTensor.to_local()``) of the parameters whose name contains
  ``.experts.``, right after ``parallelize``;
* gathered (what one layer's experts occupy on a rank while it computes, between FSDP2's
  all-gather and reshard; in backward their unsharded gradients as much again)::

      gathered = N * P / ep                        per layer

  measured: the local experts' parameters seen by a forward pre-hook on each experts module
  (after FSDP2's unshard; under ep, the ep-local slice of the unsharded DTensor).

All-to-all volume per rank per step (the ``_AllToAllV`` exchanges of the dispatch and the
combine, forward and backward; measured by wrapping ``_AllToAllV.forward`` and ``backward``
in every rank; the small exchange of split sizes, ``N`` int64 per layer and forward, is not
counted). Each rank sends ``T k`` rows of ``E b`` bytes in the dispatch's forward and in the
combine's backward, and as many rows as its experts received in the combine's forward and
the dispatch's backward (``T k`` on average over the ranks)::

      full     = 2 (dispatch + combine) * 2 (forward + backward) * L * T * k * E * b
      leaving  = full * (1 - 1 / ep)               (uniform routing)

``full`` counts every row handed to ``all_to_all_single``, the rows a rank sends to itself
included; its mean over the ranks is exact (whatever the routing). ``leaving`` counts the rows
that go to another rank: the prediction assumes every expert is equally likely, so the
measured value moves with the router's balance (the ranks' mean and their maximum are both
printed). ep 1 exchanges nothing.

Peak memory, time and threads as in ``context_parallel.py``: each rank measures around every
``train_step`` (forward, backward, clipping) the peak of its resident memory above what it
held just before step 1 (``/proc/self/status`` VmHWM after a ``/proc/self/clear_refs``
reset; this includes the optimizer state made by step 1 and whatever earlier steps left
resident), the same above what it held just before that step (``step``: the step's own
transient memory: gathered experts, their gradients, activations, all-to-all buffers), and
the step's CPU time; every rank runs ``--threads`` (default 1) intra-op threads
(``AUTOMODEL_NUM_THREADS`` and ``OMP_NUM_THREADS``), and the ranks run with
``MALLOC_MMAP_THRESHOLD_=131072`` (unless set), so that freed large tensors are unmapped. All
runs have the same ranks and threads: with ``dp`` 4 on 2 cores every run oversubscribes the
machine 2x alike, so their wall-clock numbers are comparable with each other (not with a run
on an idle machine).
"""

from __future__ import annotations

# Only cheap imports at module level: the spawned ranks re-import this file.
import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_run_arguments,
    check_run_arguments,
    finish,
    run_ranks,
)
from benchmarks.common import reset_peak as _reset_peak  # noqa: E402
from benchmarks.common import status as _status  # noqa: E402

FP32 = ("parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
        "param_dtype:float32,reduce_dtype:float32}")
KiB, MiB = 2**10, 2**20
LOSS_RTOL = 1e-5
# per family: the config keys of (number of experts, an expert's intermediate size)
FAMILIES = {"qwen3_moe": ("num_experts", "moe_intermediate_size"),
            "olmoe": ("num_experts", "intermediate_size"),
            "mixtral": ("num_local_experts", "intermediate_size")}


def _local_bytes(p) -> int:
    from torch.distributed.tensor import DTensor

    t = p.to_local() if isinstance(p, DTensor) else p
    return t.numel() * t.element_size()


def rank_entry(cfg) -> dict:
    """One rank: run the job, measuring expert memory, all-to-all bytes, memory and time."""
    import gc
    import time

    import torch
    import torch.distributed as dist

    from automodel.distributed import expert_parallel as epm
    from automodel.models.experts import expert_modules
    from automodel.recipes import components, loop
    from automodel.recipes import train as runner

    params: dict = {}
    gathered: dict[str, int] = {}  # experts module -> bytes of its parameters in forward
    a2a = {"full": 0, "leaving": 0, "calls": 0}  # this step's bytes sent by _AllToAllV

    def count(t, splits: list, group) -> None:
        row = t[0].numel() * t.element_size() if t.shape[0] else 0
        a2a["full"] += sum(splits) * row
        a2a["leaving"] += (sum(splits) - splits[dist.get_rank(group)]) * row
        a2a["calls"] += 1

    forward, backward = epm._AllToAllV.forward, epm._AllToAllV.backward

    def counted_forward(ctx, x, out_splits, in_splits, group):
        count(x, in_splits, group)  # x: sum(in_splits) rows, sent by in_splits
        return forward(ctx, x, out_splits, in_splits, group)

    def counted_backward(ctx, grad):
        count(grad, ctx.splits[0], ctx.group)  # the reverse: grad sent by out_splits
        return backward(ctx, grad)

    epm._AllToAllV.forward = staticmethod(counted_forward)
    epm._AllToAllV.backward = staticmethod(counted_backward)

    def on_forward(name):
        def hook(module, args):
            size = sum(_local_bytes(p) for p in module._parameters.values())
            gathered[name] = max(gathered.get(name, 0), size)
        return hook

    parallelize = components.parallelize

    def parallelize_and_measure(*args, **kwargs):
        parts = parallelize(*args, **kwargs)
        experts = dense = 0
        for part in parts.parts:
            for name, p in part.named_parameters():
                if ".experts." in f".{name}":
                    experts += _local_bytes(p)
                else:
                    dense += _local_bytes(p)
            for name, module in expert_modules(part).items():  # after FSDP2's own pre-hook
                module.register_forward_pre_hook(on_forward(name))
        params.update(experts_bytes=experts, dense_bytes=dense)
        return parts

    components.parallelize = parallelize_and_measure
    steps: list[dict] = []
    inner = loop.train_step

    def measured_step(*args, **kwargs):
        gc.collect()
        a2a.update(full=0, leaving=0, calls=0)
        _reset_peak()
        rss = _status("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        stats = inner(*args, **kwargs)  # on CPU the work is done when it returns
        steps.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                      "rss_before": rss, "hwm": _status("VmHWM"),
                      "a2a_full_bytes": a2a["full"], "a2a_leaving_bytes": a2a["leaving"],
                      "a2a_calls": a2a["calls"]})
        return stats

    loop.train_step = measured_step
    records = runner.run_rank(cfg)
    return {"records": records, "steps": steps, "threads": torch.get_num_threads(), **params,
            "gathered_bytes_per_layer": max(gathered.values(), default=0),
            "experts_modules": len(gathered)}


def overrides(args, ep: int) -> list[str]:
    n_key, i_key = FAMILIES[args.family]
    return ["parallelism=fsdp2", FP32, f"mesh.dp_size={args.dp}", f"mesh.ep_size={ep}",
            f"model={args.family}_tiny", f"model.config.hidden_size={args.hidden}",
            f"model.config.{n_key}={args.experts}", f"model.config.{i_key}={args.moe_intermediate}",
            f"model.config.num_experts_per_tok={args.top_k}",
            f"model.config.num_hidden_layers={args.layers}",
            f"model.config.max_position_embeddings={args.seq}",
            "data=synthetic", f"data.num_sequences={args.batch * args.steps}",
            f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
            f"trainer.seq_len={args.seq}", "trainer.log_every=1",
            "optim.warmup_steps=0", "optim.min_lr_ratio=1.0", *args.override]


def measure(args, ep: int) -> dict:
    ranks = run_ranks(overrides(args, ep), rank_entry, name="epbench")
    nproc = len(ranks)
    records = ranks[0]["records"]
    after = slice(args.warmup, None)  # the steps after the warmup
    per_rank = []
    for r in ranks:
        s = r["steps"]
        first = s[0]["rss_before"]
        per_rank.append({
            "threads": r["threads"], "experts_bytes": r["experts_bytes"],
            "dense_bytes": r["dense_bytes"],
            "gathered_bytes_per_layer": r["gathered_bytes_per_layer"],
            "experts_modules": r["experts_modules"],
            "held_before_step1_bytes": first,
            "peak_bytes": max(x["hwm"] - first for x in s[after]),
            "own_step_peaks_bytes": [x["hwm"] - x["rss_before"] for x in s],
            "a2a_full_bytes": [x["a2a_full_bytes"] for x in s],
            "a2a_leaving_bytes": [x["a2a_leaving_bytes"] for x in s],
            "a2a_calls": [x["a2a_calls"] for x in s],
            "wall_s": [x["wall_s"] for x in s], "cpu_s": [x["cpu_s"] for x in s]})
    steps = range(len(records))[after]

    def a2a(key: str, reduce) -> float:  # per step: reduce over the ranks; then the mean
        return statistics.mean(reduce([p[key][i] for p in per_rank]) for i in steps)

    return {
        "ep": ep, "ep_shard": args.dp // ep, "ranks": nproc,
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "aux_losses": [r.get("aux_loss") for r in records],
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in records[after]),
        "tokens_per_second_steps": [r["tokens_per_second"] for r in records],
        # per step: the slowest rank's step time, all ranks' CPU time together
        "step_wall_s": statistics.median(max(p["wall_s"][i] for p in per_rank) for i in steps),
        "step_cpu_s": statistics.median(sum(p["cpu_s"][i] for p in per_rank) for i in steps),
        "peak_bytes": max(p["peak_bytes"] for p in per_rank),
        "step_peak_bytes": max(max(p["own_step_peaks_bytes"][after]) for p in per_rank),
        "held_bytes": max(p["held_before_step1_bytes"] for p in per_rank),
        "experts_bytes": max(p["experts_bytes"] for p in per_rank),
        "experts_bytes_min": min(p["experts_bytes"] for p in per_rank),
        "dense_bytes": max(p["dense_bytes"] for p in per_rank),
        "gathered_bytes_per_layer": max(p["gathered_bytes_per_layer"] for p in per_rank),
        "a2a_full_mean_bytes": a2a("a2a_full_bytes", statistics.mean),
        "a2a_full_max_bytes": a2a("a2a_full_bytes", max),
        "a2a_leaving_mean_bytes": a2a("a2a_leaving_bytes", statistics.mean),
        "a2a_leaving_max_bytes": a2a("a2a_leaving_bytes", max),
        "per_rank": per_rank,
    }


def predicted(args, ep: int) -> dict:
    """The module docstring's formulas (bytes)."""
    b = 4  # fp32 parameters and activations
    N, L, E, k = args.experts, args.layers, args.hidden, args.top_k
    per_expert = 3 * E * args.moe_intermediate * b
    T = args.batch * args.seq // args.dp
    full = 2 * 2 * L * T * k * E * b if ep > 1 else 0
    return {"per_expert_bytes": per_expert,
            "experts_bytes": L * N * per_expert // (ep * (args.dp // ep)),
            "gathered_bytes_per_layer": N * per_expert // ep,
            "a2a_full_bytes": full, "a2a_leaving_bytes": full * (1 - 1 / ep)}


def _rel(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4],
                   help="ep sizes to run (1 is the baseline and always runs)")
    p.add_argument("--dp", type=int, default=4, help="ranks (mesh.dp_size) in every run")
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe",
                   help="the preset conf/model/<family>_tiny.yaml, resized by the flags")
    p.add_argument("--experts", type=int, default=16, help="experts per layer")
    p.add_argument("--moe-intermediate", type=int, default=256,
                   help="an expert's intermediate size")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    add_run_arguments(p, batch=8, steps=5, warmup=2)
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    if args.batch % args.dp:
        p.error("--batch must be a multiple of --dp")
    for ep in args.ep:
        if args.dp % ep or args.experts % ep:
            p.error(f"ep {ep} must divide --dp {args.dp} and --experts {args.experts}")
    os.environ["OMP_NUM_THREADS"] = os.environ["AUTOMODEL_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    eps = [1] + [e for e in args.ep if e != 1]
    cores = os.cpu_count() or 1
    tokens = args.batch * args.seq // args.dp
    print(f"model: {args.family}, hidden {args.hidden}, {args.layers} layers of {args.experts} "
          f"experts (intermediate {args.moe_intermediate}), top-{args.top_k}; {args.dp} ranks "
          f"(dp {args.dp}) in every run, batch {args.batch} x seq {args.seq} "
          f"({tokens} tokens per rank); {args.steps} steps (medians over steps "
          f"{args.warmup + 1}-{args.steps}); {args.threads} thread(s) per rank on {cores} "
          "cores\n")
    rows = []
    for ep in eps:
        row = measure(args, ep)
        row["predicted"] = predicted(args, ep)
        rows.append(row)
    base = rows[0]
    ok = True
    for row in rows:
        row["loss_max_rel_diff"] = _rel(row["losses"], base["losses"])
        row["grad_norm_max_rel_diff"] = _rel(row["grad_norms"], base["grad_norms"])
        ok &= row["loss_max_rel_diff"] <= LOSS_RTOL
        row["cpu_ratio"] = row["step_cpu_s"] / base["step_cpu_s"]
    per_expert = rows[0]["predicted"]["per_expert_bytes"]
    print(f"expert parameters per rank (one expert: {per_expert / KiB:.0f} KiB; all of them "
          f"{args.layers * args.experts * per_expert / MiB:.1f} MiB): sharded = the local "
          "shards after parallelize, all layers (pred L N P / (ep ep_shard)); gathered = one "
          "layer's experts as seen in forward (pred N P / ep); dense = the other parameters' "
          "local shards; held: resident before step 1; peak: the largest rank's resident "
          "growth through a step above held (optimizer state and what earlier steps left "
          "included); step: the same above what the rank held just before that step")
    print(f"{'layout':<14} {'sharded KiB':>11} {'pred':>7} {'gathered KiB':>12} {'pred':>7} "
          f"{'dense KiB':>9} {'held MiB':>8} {'peak MiB':>8} {'peak-ep1':>8} {'step MiB':>8} "
          f"{'step-ep1':>8}")
    for row in rows:
        pr = row["predicted"]
        name = f"ep{row['ep']} (shard {row['ep_shard']})"
        print(f"{name:<14} {row['experts_bytes'] / KiB:>11.0f} {pr['experts_bytes'] / KiB:>7.0f} "
              f"{row['gathered_bytes_per_layer'] / KiB:>12.0f} "
              f"{pr['gathered_bytes_per_layer'] / KiB:>7.0f} {row['dense_bytes'] / KiB:>9.0f} "
              f"{row['held_bytes'] / MiB:>8.0f} {row['peak_bytes'] / MiB:>8.1f} "
              f"{(row['peak_bytes'] - base['peak_bytes']) / MiB:>+8.1f} "
              f"{row['step_peak_bytes'] / MiB:>8.1f} "
              f"{(row['step_peak_bytes'] - base['step_peak_bytes']) / MiB:>+8.1f}")
    print("\nall-to-all KiB sent per rank per step (dispatch + combine, forward + backward): "
          "full = every row (self included), mean and max over ranks, pred exact for the "
          "mean; leaving = to other ranks, mean and max over ranks, pred for uniform routing; "
          "tok/s median; cpu s: CPU seconds per step of all ranks")
    print(f"{'layout':<14} {'full KiB':>9} {'max':>7} {'pred':>7} {'leave KiB':>9} {'max':>7} "
          f"{'pred':>7} {'meas/pred':>9} {'tok/s':>7} {'cpu s':>6} {'cpu x':>6} {'final loss':>10} "
          f"{'loss rel d':>10} {'gnorm rel d':>11}")
    for row in rows:
        pr = row["predicted"]
        name = f"ep{row['ep']} (shard {row['ep_shard']})"
        ratio = (f"{row['a2a_leaving_mean_bytes'] / pr['a2a_leaving_bytes']:>9.3f}"
                 if pr["a2a_leaving_bytes"] else f"{'-':>9}")
        print(f"{name:<14} {row['a2a_full_mean_bytes'] / KiB:>9.0f} "
              f"{row['a2a_full_max_bytes'] / KiB:>7.0f} "
              f"{pr['a2a_full_bytes'] / KiB:>7.0f} {row['a2a_leaving_mean_bytes'] / KiB:>9.0f} "
              f"{row['a2a_leaving_max_bytes'] / KiB:>7.0f} {pr['a2a_leaving_bytes'] / KiB:>7.0f} "
              f"{ratio} {row['tokens_per_second']:>7.0f} {row['step_cpu_s']:>6.2f} "
              f"{row['cpu_ratio']:>6.2f} {row['losses'][-1]:>10.6f} "
              f"{row['loss_max_rel_diff']:>10.1e} {row['grad_norm_max_rel_diff']:>11.1e}")
    if args.dp * args.threads > cores:
        print(f"(every run: {args.dp} ranks x {args.threads} thread(s) on {cores} cores, "
              "oversubscribed alike)")
    finish(ok, "ep 1", LOSS_RTOL, args, rows)


if __name__ == "__main__":
    main()
