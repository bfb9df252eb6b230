"""Context parallelism on CPU: memory per rank, throughput and overhead against one rank.

Trains the same job (a tiny Llama built from config, one long sequence per step) with
``mesh.cp_size`` 1, 2 and 4 (ring: all-gathered K/V; ``--ulysses`` adds cp 4 as 2 ring x 2
Ulysses), FSDP2 in fp32 and dp 1 in every run, so every run processes the same total tokens
per step and must report the same losses. Each rank measures, around every ``train_step``
(forward, backward, clipping): the peak of its resident memory above what it held just before
the first step (``/proc/self/status`` VmHWM after a ``/proc/self/clear_refs`` reset), and the
step's wall and CPU time. The table compares them with a prediction and with cp 1.

    python benchmarks/context_parallel.py                   # seq 8192, cp 1 2 4: ~2 min, 2 cores
    python benchmarks/context_parallel.py --ulysses --json cp.json
    python benchmarks/context_parallel.py --sdpa math --seq 4096  # the textbook attention

Predicted activation memory per rank (bytes; fp32, no activation checkpointing). Notation:
``B`` batch, ``S`` sequence, ``L`` layers, ``E`` hidden, ``F`` intermediate, ``V`` vocabulary,
``H`` heads of ``D`` dims, ``cp = r x u`` (ring x Ulysses), ``T = S / cp`` tokens held per
rank, ``Q = S / r`` queries per attention call (a Ulysses group's tokens, ``H / u`` heads).

* per token (everything outside attention works on the ``T`` local tokens)::

      tokens = 4 * B * T * (L * (10 E + 4 F) + 3 V)

  per layer: both norms' inputs and outputs, q/k/v, rotated q/k, the attention output, the
  residual, gate, up, act(gate), act(gate) * up (~10 E + 4 F floats); at the head: logits,
  their log-softmax and, in backward, their gradient (3 V).
* attention. A cp rank's queries (after the Ulysses exchange: ``2 u`` chunks of ``C = S / (2
  cp)`` tokens, global chunk indices ``c``) each attend to the ``(c + 1) C`` keys up to their
  own end, so the query-key products of a rank add up to ``K = u * C^2 * (2 cp + 1)``
  (``S^2 / 2`` at cp 1, about ``S^2 / (2 cp)`` beyond). The gathered keys and values, repeated
  to ``H / u`` heads over the whole sequence, are saved in every layer when cp > 1::

      kv = L * 2 * 4 * B * (H / u) * S * D

  ``--sdpa auto`` (SDPA's choice: its flash kernel on CPU). cp 1 passes ``is_causal`` and no
  mask: nothing of size S^2 exists. cp > 1 passes each query chunk a float mask of its
  ``C x (c + 1) C`` keys (on CUDA none: the lower-right causal mode of the flash kernel),
  built once and shared by all layers and steps::

      attention(cp = 1) = 0
      attention(cp > 1) = 4 * K + kv

  ``--sdpa math`` (``sdpa_kernel(MATH)`` in every rank): the probabilities of every
  query-key product are saved in every layer (``S^2`` at cp 1: the textbook kernel computes
  the masked half too); the last layer's backward holds two more of that size::

      attention(cp = 1) = (L + 2) * 4 * B * H * S^2
      attention(cp > 1) = (L + 2) * 4 * B * (H / u) * K  +  4 * K  +  kv

``predicted = tokens + attention``; ``measured / predicted`` is printed beside it. Measured is
the peak resident growth, so it also holds what the step allocates and frees (gradients,
FSDP2's unsharded parameters, gloo buffers, the boolean mask while it is converted): the
ratio is expected a little above 1 where attention dominates.

Threads: every rank runs ``--threads`` (default 1) intra-op threads in all runs
(``AUTOMODEL_NUM_THREADS``, which the runner applies, and ``OMP_NUM_THREADS``), so cp 1 on one
rank does not get more threads than each cp rank. With 2 cores, cp 2 fills the machine and
cp 4 oversubscribes it 2x: its wall-clock tokens/s is not comparable, its CPU time is. The
overhead of the cp path is therefore reported as CPU time: the per-step CPU seconds of all
ranks together over those of cp 1 at equal total tokens (1.0 = no extra work). The wall-clock
ratio, ``cp x`` its step time over cp 1's (tokens/s per rank), is printed beside it.

glibc keeps freed memory below its dynamic mmap threshold (up to 32 MiB) in the heap, where it
still counts as resident; the ranks run with ``MALLOC_MMAP_THRESHOLD_=131072`` (unless set) so
that large tensors are unmapped when freed and one step's leftovers do not hide the next
step's peak.
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
MiB = 2**20
LOSS_RTOL = 1e-5


def rank_entry(cfg, sdpa: str) -> dict:
    """One rank: run the job, measuring memory and time around each ``train_step``."""
    import contextlib
    import gc
    import time

    import torch

    from automodel.recipes import loop
    from automodel.recipes import train as runner

    steps: list[dict] = []
    inner = loop.train_step

    def measured_step(*args, **kwargs):
        gc.collect()
        _reset_peak()
        rss = _status("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        stats = inner(*args, **kwargs)  # on CPU the work is done when it returns
        steps.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                      "rss_before": rss, "hwm": _status("VmHWM")})
        return stats

    loop.train_step = measured_step
    ctx = contextlib.nullcontext()
    if sdpa == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel(SDPBackend.MATH)
    with ctx:
        records = runner.run_rank(cfg)
    return {"records": records, "steps": steps, "threads": torch.get_num_threads()}


def overrides(args, cp: int, ulysses: int) -> list[str]:
    return ["parallelism=fsdp2", FP32, f"mesh.cp_size={cp}", "mesh.dp_size=1",
            *([f"mesh.cp_ulysses_size={ulysses}"] if ulysses > 1 else []),
            "model=llama_tiny", f"model.config.hidden_size={args.hidden}",
            f"model.config.intermediate_size={args.hidden * 11 // 4}",
            f"model.config.num_hidden_layers={args.layers}",
            f"model.config.num_attention_heads={args.heads}",
            f"model.config.num_key_value_heads={args.kv_heads}",
            f"model.config.vocab_size={args.vocab}",
            f"model.config.max_position_embeddings={args.seq}",
            "data=synthetic", f"data.num_sequences={args.batch * args.steps}",
            f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
            f"trainer.seq_len={args.seq}", "trainer.log_every=1",
            "optim.warmup_steps=0", "optim.min_lr_ratio=1.0", *args.override]


def measure(args, cp: int, ulysses: int) -> dict:
    ranks = run_ranks(overrides(args, cp, ulysses), rank_entry, args.sdpa, name="cpbench")
    nproc = len(ranks)
    records = ranks[0]["records"]
    after = slice(args.warmup, None)  # the steps after the warmup
    per_rank = []
    for r in ranks:
        s = r["steps"]
        first = s[0]["rss_before"]
        per_rank.append({
            "threads": r["threads"], "held_before_step1_bytes": first,
            "peak_bytes": max(x["hwm"] - first for x in s[after]),
            "step1_peak_bytes": s[0]["hwm"] - first,
            "own_step_peaks_bytes": [x["hwm"] - x["rss_before"] for x in s],
            "wall_s": [x["wall_s"] for x in s], "cpu_s": [x["cpu_s"] for x in s]})
    steps = range(len(records))[after]
    return {
        "cp": cp, "ring": cp // ulysses, "ulysses": ulysses, "ranks": nproc,
        "losses": [r["loss"] for r in records],
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in records[after]),
        "tokens_per_second_steps": [r["tokens_per_second"] for r in records],
        # per step: the slowest rank's step time, all ranks' CPU time together
        "step_wall_s": statistics.median(max(p["wall_s"][i] for p in per_rank) for i in steps),
        "step_cpu_s": statistics.median(sum(p["cpu_s"][i] for p in per_rank) for i in steps),
        "peak_bytes": max(p["peak_bytes"] for p in per_rank),
        "per_rank": per_rank,
    }


def predicted_bytes(args, cp: int, ulysses: int) -> dict:
    """The module docstring's formula: {"tokens": ..., "attention": ..., "total": ...}."""
    B, S, L, E, V, H = args.batch, args.seq, args.layers, args.hidden, args.vocab, args.heads
    F, D = E * 11 // 4, E // H
    T, Hl, C = S // cp, H // ulysses, S // (2 * cp)
    tokens = 4 * B * T * (L * (10 * E + 4 * F) + 3 * V)
    if cp == 1:
        attention = (L + 2) * 4 * B * H * S * S if args.sdpa == "math" else 0
    else:
        products = ulysses * C * C * (2 * cp + 1)
        attention = 4 * products + L * 2 * 4 * B * Hl * S * D
        if args.sdpa == "math":
            attention += (L + 2) * 4 * B * Hl * products
    return {"tokens": tokens, "attention": attention, "total": tokens + attention}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4],
                   help="ring cp sizes to run (1 is the baseline and always runs)")
    p.add_argument("--ulysses", action="store_true",
                   help="also cp 4 as 2 ring x 2 Ulysses")
    p.add_argument("--seq", type=int, default=8192)
    add_run_arguments(p, batch=1, steps=5, warmup=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--sdpa", choices=["auto", "math"], default="auto",
                   help="auto: SDPA's own choice (flash on CPU); math: force the math kernel")
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    os.environ["OMP_NUM_THREADS"] = os.environ["AUTOMODEL_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    layouts = [(1, 1)] + [(c, 1) for c in args.cp if c != 1]
    if args.ulysses:
        layouts.append((4, 2))
    cores = os.cpu_count() or 1
    print(f"model: llama, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
          f"({args.kv_heads} kv), vocab {args.vocab}; batch {args.batch} x seq {args.seq}; "
          f"{args.steps} steps (medians over steps {args.warmup + 1}-{args.steps}); "
          f"{args.threads} thread(s) per rank on {cores} cores; sdpa {args.sdpa}\n")
    rows = []
    for cp, u in layouts:
        row = measure(args, cp, u)
        row["predicted"] = predicted_bytes(args, cp, u)
        rows.append(row)
    base = rows[0]
    ok = True
    for row in rows:
        rel = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], base["losses"]))
        row["loss_max_rel_diff"] = rel
        ok &= rel <= LOSS_RTOL
        row["cpu_overhead"] = row["step_cpu_s"] / base["step_cpu_s"]
        row["rank_time_overhead"] = row["ranks"] * row["step_wall_s"] / base["step_wall_s"]
        row["oversubscribed"] = row["ranks"] * args.threads > cores
    print("peak: the largest rank's resident growth through a step's forward, backward and "
          "clipping, above what it held before step 1; predicted: the docstring's formula; "
          "cpu x: CPU seconds per step of all ranks over cp 1's; wall x: ranks x step time "
          "over cp 1's")
    head = (f"{'layout':<10} {'ranks':>5} {'held MiB':>8} {'peak MiB':>8} {'pred MiB':>8} "
            f"{'meas/pred':>9} {'peak/cp1':>8} {'tok/s':>7} {'cpu s':>6} {'cpu x':>6} "
            f"{'wall x':>6} {'final loss':>10} {'max rel d':>9}")
    print(head)
    for row in rows:
        name = f"cp{row['cp']}" + (f" {row['ring']}x{row['ulysses']}u" if row["ulysses"] > 1
                                   else "")
        held = max(r["held_before_step1_bytes"] for r in row["per_rank"])
        pred = row["predicted"]["total"]
        print(f"{name:<10} {row['ranks']:>5} {held / MiB:>8.0f} {row['peak_bytes'] / MiB:>8.1f} "
              f"{pred / MiB:>8.1f} {row['peak_bytes'] / pred:>9.2f} "
              f"{row['peak_bytes'] / base['peak_bytes']:>8.2f} "
              f"{row['tokens_per_second']:>7.0f} {row['step_cpu_s']:>6.2f} "
              f"{row['cpu_overhead']:>6.2f} {row['rank_time_overhead']:>6.2f}"
              f"{'*' if row['oversubscribed'] else ' '}"
              f"{row['losses'][-1]:>10.6f} {row['loss_max_rel_diff']:>9.1e}")
    if any(r["oversubscribed"] for r in rows):
        print(f"* more rank threads than the {cores} cores: wall-clock numbers are not "
              "comparable")
    finish(ok, "cp 1", LOSS_RTOL, args, rows)


if __name__ == "__main__":
    main()
