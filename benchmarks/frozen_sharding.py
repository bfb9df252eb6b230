"""A frozen vision tower under FSDP2 on CPU: its memory per rank for each
``parallelism.multimodal.frozen_sharding`` policy, throughput, loss agreement.

Trains the same job (``model=llava_tiny`` built from config, its CLIP vision tower made large
against a small Llama language model, ``model.freeze=[vision]``, FSDP2 in fp32, every sample an
image) with ``frozen_sharding`` root, per_layer and replicate, on ``--ranks`` ranks (default
2: ``mesh.dp_size``), so every run trains the same thing and must report the same losses.

    python benchmarks/frozen_sharding.py                      # 3 policies on 2 ranks, ~45 s
    python benchmarks/frozen_sharding.py --ranks 2 4 --json frozen.json   # and on 4 ranks
    python benchmarks/frozen_sharding.py --vision-layers 12 --steps 3     # a larger tower

Notation: ``T`` the tower's parameter bytes (all of ``model.vision_tower``: the patch and
position embeddings, ``n`` encoder layers, the layer norms), ``B`` one encoder layer's bytes,
``r`` ranks. The FSDP2 units (``automodel/distributed/frozen.py``): the blocks are the tower's
embeddings and its ``n`` layers, then the language model's layers; the projector, the language
model's embeddings, norm and head and the tower's two layer norms are the root's.

* root: the frozen tower blocks are no units; all of the tower joins the root unit;
* per_layer: every tower block is a unit of its own (its layer norms stay in the root);
* replicate: the tower's parameters are FSDP2's ``ignored_params``: whole plain tensors.

What each rank measures, and the prediction:

* **sharded**: the bytes of the tower's parameters a rank holds outside a step, right after
  ``parallelize``: ``to_local()`` of DTensor parameters, the full size of plain ones::

      root, per_layer:  T / r      (the mean over the ranks; dim-0 shards of rows that do not
                                    divide by r differ by a row between ranks)
      replicate:        T

* **gathered**: the largest number of tower bytes FSDP2 holds unsharded at once, read after
  every ``FSDPParamGroup.wait_for_unshard`` (the tower's ``FSDPParam``s in state
  ``UNSHARDED``; replicate's whole tensors are not counted: they are resident, not gathered)::

      root: T         (the root unit: the whole tower, gathered at the start of the forward)
      per_layer: B    (one block at a time)
      replicate: 0

* **all-gathered**: the tower bytes FSDP2 all-gathers per step (every ``FSDPParamGroup.unshard``
  that starts an all-gather, the tower's share of its group at full size), in forward and in
  backward (the autograd engine running: ``torch._C._current_graph_task_id() >= 0``).
  Predicted: ``T`` in forward for root and per_layer, nothing in backward (nothing of a frozen
  tower runs backward), 0 for replicate.
* **peak**, **fwd**, **step** and **top**: as in ``context_parallel.py`` and
  ``expert_parallel.py``, the peak of the rank's resident memory (``VmHWM`` after a
  ``/proc/self/clear_refs`` reset) through a step's forward, backward and clipping, above what
  it held just before step 1 (``peak``) and above what it held just before that step
  (``step``); ``fwd`` is the latter read at the end of the model's forward (a forward hook
  after FSDP2's own), ``top`` is ``held + peak``; the largest rank, the largest step after
  ``--warmup``. Everything but the tower is the same in the three runs, so the prediction is
  for the difference from replicate (whose whole tower is already in what it held)::

      peak - peak(replicate):   root: T,   per_layer: B,   replicate: 0

  ``held`` (resident before step 1) is printed too: replicate's should exceed root's by about
  ``T (1 - 1/r)``, within the noise of some 350 MiB of imports. FSDP2 all-gathers a unit into
  one flat buffer (gloo through a flat temporary of its own) and then copies it out into the
  unit's unsharded parameters, so a unit costs twice its size for a moment (the README's
  section has the measured consequences).
* **tok/s** (median of the per-step records after the warmup: the whole step), **step s** (the
  slowest rank's ``train_step`` wall time, median), **cpu s** (CPU seconds of one
  ``train_step`` summed over the ranks, median after the warmup), **cpu x** (over the first
  policy's at the same ranks: root's by default); every rank runs ``--threads`` (default 1)
  intra-op threads (``AUTOMODEL_NUM_THREADS``, ``OMP_NUM_THREADS``). With 4 ranks on 2 cores
  the machine is oversubscribed 2x: compare wall-clock numbers only at equal ranks.
* **loss**: every step's loss must agree with the first run's (root on the first ``--ranks``)
  to 1e-5 relative ("loss ok"; the script exits 1 otherwise).

The ranks run with ``MALLOC_MMAP_THRESHOLD_=131072`` (unless set), so that glibc unmaps freed
large tensors instead of keeping them resident, where they would hide the next step's peak.
"""

from __future__ import annotations

# Only cheap imports at module level: the spawned ranks re-import this file.
import argparse
import os
import statistics
import sys
import tempfile
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
POLICIES = ("root", "per_layer", "replicate")


def _local_bytes(p) -> int:
    from torch.distributed.tensor import DTensor

    t = p.to_local() if isinstance(p, DTensor) else p
    return t.numel() * t.element_size()


def rank_entry(cfg) -> dict:
    """One rank: run the job, measuring the tower's bytes (held, gathered, all-gathered), the
    resident memory and the time of every step."""
    import gc
    import time

    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from automodel.models.parts import group_of
    from automodel.recipes import components, loop
    from automodel.recipes import train as runner

    info: dict = {}
    tower_params: dict = {}  # id(FSDPParamGroup) -> the tower's FSDPParams in it
    # this step's (reset per step): tower bytes all-gathered in forward and in backward, the
    # most tower bytes unsharded at once, the resident peak at the end of the model's forward
    step = {"forward": 0, "backward": 0, "unsharded_max": 0, "forward_hwm": 0}

    def full_bytes(fsdp_param) -> int:
        return fsdp_param._orig_size.numel() * fsdp_param.sharded_param.element_size()

    unshard, wait_for_unshard = FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard

    def counted_unshard(group, *args, **kwargs):
        if group._all_gather_result is None and not group.is_unsharded:  # an all-gather starts
            phase = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
            step[phase] += sum(full_bytes(fp) for fp in tower_params.get(id(group), ()))
        return unshard(group, *args, **kwargs)

    def measured_wait(group, *args, **kwargs):
        out = wait_for_unshard(group, *args, **kwargs)
        held = sum(full_bytes(fp) for fps in tower_params.values() for fp in fps
                   if fp.sharded_state == ShardedState.UNSHARDED)
        step["unsharded_max"] = max(step["unsharded_max"], held)
        return out

    FSDPParamGroup.unshard = counted_unshard
    FSDPParamGroup.wait_for_unshard = measured_wait
    parallelize = components.parallelize

    def parallelize_and_measure(*args, **kwargs):
        parts = parallelize(*args, **kwargs)
        tower = tower_full = other = 0
        tower_slots = set()  # (module, parameter name) of the tower's parameters
        for part in parts.parts:
            for mname, module in part.named_modules():
                for pname, p in module.named_parameters(recurse=False):
                    if group_of(f"{mname}.{pname}") == "vision":
                        tower_slots.add((id(module), pname))
                        tower += _local_bytes(p)
                        tower_full += p.numel() * p.element_size()  # a DTensor's global size
                    else:
                        other += _local_bytes(p)
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    for group in module._get_fsdp_state()._fsdp_param_groups:
                        fps = [fp for fp in group.fsdp_params
                               if (id(fp._module_info.module), fp._module_info.param_name)
                               in tower_slots]
                        if fps:
                            tower_params[id(group)] = fps
        for part in parts.parts:  # after FSDP2's own post-forward hook (the root's reshard)
            part.register_forward_hook(forward_done)
        info.update(tower_bytes=tower, tower_full_bytes=tower_full, other_bytes=other,
                    tower_units=len(tower_params))
        return parts

    def forward_done(module, args, output):
        step["forward_hwm"] = _status("VmHWM")

    components.parallelize = parallelize_and_measure
    steps: list[dict] = []
    inner = loop.train_step

    def measured_step(*args, **kwargs):
        gc.collect()
        step.update(forward=0, backward=0, unsharded_max=0, forward_hwm=0)
        _reset_peak()
        rss = _status("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        stats = inner(*args, **kwargs)  # on CPU the work is done when it returns
        steps.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                      "rss_before": rss, "hwm": _status("VmHWM"), "fwd_hwm": step["forward_hwm"],
                      "gathered_forward_bytes": step["forward"],
                      "gathered_backward_bytes": step["backward"],
                      "unsharded_max_bytes": step["unsharded_max"]})
        return stats

    loop.train_step = measured_step
    records = runner.run_rank(cfg)
    return {"records": records, "steps": steps, "threads": torch.get_num_threads(), **info}


def overrides(args, policy: str, ranks: int) -> list[str]:
    v = "model.config.vision_config"
    return ["parallelism=fsdp2", FP32, f"mesh.dp_size={ranks}",
            f"parallelism.multimodal.frozen_sharding={policy}",
            "model=llava_tiny", "model.freeze=[vision]",
            f"{v}.hidden_size={args.vision_hidden}",
            f"{v}.intermediate_size={args.vision_hidden * 4}",
            f"{v}.num_hidden_layers={args.vision_layers}",
            f"{v}.num_attention_heads={args.vision_hidden // 64}",
            f"model.config.text_config.num_hidden_layers={args.text_layers}",
            "data=synthetic", f"data.num_sequences={args.batch * args.steps}",
            f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
            f"trainer.seq_len={args.seq}", "trainer.log_every=1",
            "optim.warmup_steps=0", "optim.min_lr_ratio=1.0", *args.override]


def measure(args, policy: str, ranks: int) -> dict:
    out = run_ranks(overrides(args, policy, ranks), rank_entry, name="frozenbench")
    nproc = len(out)
    records = out[0]["records"]
    after = slice(args.warmup, None)  # the steps after the warmup
    per_rank = []
    for r in out:
        s = r["steps"]
        first = s[0]["rss_before"]
        per_rank.append({
            "threads": r["threads"], "tower_bytes": r["tower_bytes"],
            "tower_full_bytes": r["tower_full_bytes"], "other_bytes": r["other_bytes"],
            "tower_units": r["tower_units"], "held_before_step1_bytes": first,
            "peak_bytes": max(x["hwm"] - first for x in s[after]),
            "own_step_peaks_bytes": [x["hwm"] - x["rss_before"] for x in s],
            "top_bytes": max(x["hwm"] for x in s[after]),
            "own_forward_peaks_bytes": [x["fwd_hwm"] - x["rss_before"] for x in s],
            "gathered_forward_bytes": [x["gathered_forward_bytes"] for x in s],
            "gathered_backward_bytes": [x["gathered_backward_bytes"] for x in s],
            "unsharded_max_bytes": [x["unsharded_max_bytes"] for x in s],
            "wall_s": [x["wall_s"] for x in s], "cpu_s": [x["cpu_s"] for x in s]})
    steps = range(len(records))[after]
    return {
        "policy": policy, "ranks": nproc,
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in records[after]),
        "tokens_per_second_steps": [r["tokens_per_second"] for r in records],
        # per step: the slowest rank's step time, all ranks' CPU time together
        "step_wall_s": statistics.median(max(p["wall_s"][i] for p in per_rank) for i in steps),
        "step_cpu_s": statistics.median(sum(p["cpu_s"][i] for p in per_rank) for i in steps),
        "tower_full_bytes": per_rank[0]["tower_full_bytes"],
        "tower_bytes_mean": statistics.mean(p["tower_bytes"] for p in per_rank),
        "tower_bytes_max": max(p["tower_bytes"] for p in per_rank),
        "other_bytes_max": max(p["other_bytes"] for p in per_rank),
        "tower_units": per_rank[0]["tower_units"],
        "gathered_max_bytes": max(max(p["unsharded_max_bytes"][after]) for p in per_rank),
        "all_gathered_forward_bytes": max(max(p["gathered_forward_bytes"][after])
                                          for p in per_rank),
        "all_gathered_backward_bytes": max(max(p["gathered_backward_bytes"][after])
                                           for p in per_rank),
        "held_bytes": max(p["held_before_step1_bytes"] for p in per_rank),
        "peak_bytes": max(p["peak_bytes"] for p in per_rank),
        "step_peak_bytes": max(max(p["own_step_peaks_bytes"][after]) for p in per_rank),
        "top_bytes": max(p["top_bytes"] for p in per_rank),
        "forward_peak_bytes": max(max(p["own_forward_peaks_bytes"][after]) for p in per_rank),
        "per_rank": per_rank,
    }


def tower_sizes(args) -> dict:
    """T (all of the tower) and B (one encoder layer), in bytes, from the config alone."""
    from automodel.api import load_config
    from automodel.models.builder import build_meta_model

    cfg = load_config(overrides(args, "root", 1), output_dir=tempfile.mkdtemp(prefix="frozenb-"))
    model = build_meta_model(cfg.model)
    tower = model.model.vision_tower

    def size(module) -> int:
        return sum(p.numel() * 4 for p in module.parameters())  # fp32

    return {"tower_bytes": size(tower), "layer_bytes": size(tower.encoder.layers[0]),
            "model_bytes": size(model)}


def predicted(sizes: dict, policy: str, ranks: int) -> dict:
    """The module docstring's predictions (bytes)."""
    T, B = sizes["tower_bytes"], sizes["layer_bytes"]
    return {"tower_bytes": T if policy == "replicate" else T / ranks,
            "gathered_bytes": {"root": T, "per_layer": B, "replicate": 0}[policy],
            "all_gathered_forward_bytes": 0 if policy == "replicate" else T,
            "all_gathered_backward_bytes": 0,
            "peak_minus_replicate_bytes": {"root": T, "per_layer": B, "replicate": 0}[policy]}


def _rel(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2],
                   help="rank counts (mesh.dp_size) to run every policy on")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--vision-hidden", type=int, default=256,
                   help="the tower's hidden size (intermediate 4x, heads of 64)")
    p.add_argument("--vision-layers", type=int, default=6)
    p.add_argument("--text-layers", type=int, default=2,
                   help="language model layers (hidden 64, intermediate 176)")
    p.add_argument("--seq", type=int, default=64)
    add_run_arguments(p, batch=8, steps=4, warmup=1)
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    if any(args.batch % r for r in args.ranks):
        p.error("--batch must be a multiple of every --ranks")
    if "replicate" not in args.policies:
        args.policies.append("replicate")  # the reference for the peak
    os.environ["OMP_NUM_THREADS"] = os.environ["AUTOMODEL_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    sizes = tower_sizes(args)
    cores = os.cpu_count() or 1
    print(f"model: llava, vision tower hidden {args.vision_hidden}, {args.vision_layers} layers "
          f"(T = {sizes['tower_bytes'] / MiB:.2f} MiB, one layer B = "
          f"{sizes['layer_bytes'] / KiB:.0f} KiB) of {sizes['model_bytes'] / MiB:.2f} MiB; "
          f"language model hidden 64, {args.text_layers} layers; model.freeze=[vision]; "
          f"batch {args.batch} x seq {args.seq}, an image each; {args.steps} steps (medians "
          f"over steps {args.warmup + 1}-{args.steps}); {args.threads} thread(s) per rank on "
          f"{cores} cores\n")
    rows = []
    for ranks in args.ranks:
        for policy in [q for q in POLICIES if q in args.policies]:
            row = measure(args, policy, ranks)
            row["predicted"] = predicted(sizes, policy, ranks)
            rows.append(row)
    first = rows[0]
    ok = True
    for row in rows:
        same = [r for r in rows if r["ranks"] == row["ranks"]]
        base = same[0]
        repl = next(r for r in same if r["policy"] == "replicate")
        row["loss_max_rel_diff"] = _rel(row["losses"], first["losses"])
        row["grad_norm_max_rel_diff"] = _rel(row["grad_norms"], first["grad_norms"])
        ok &= row["loss_max_rel_diff"] <= LOSS_RTOL
        row["cpu_ratio"] = row["step_cpu_s"] / base["step_cpu_s"]
        row["held_minus_first_bytes"] = row["held_bytes"] - base["held_bytes"]
        row["peak_minus_replicate_bytes"] = row["peak_bytes"] - repl["peak_bytes"]
        row["step_minus_replicate_bytes"] = row["step_peak_bytes"] - repl["step_peak_bytes"]
        row["top_minus_replicate_bytes"] = row["top_bytes"] - repl["top_bytes"]
        row["forward_minus_replicate_bytes"] = (row["forward_peak_bytes"]
                                                - repl["forward_peak_bytes"])
    print("tower parameters per rank: sharded = its local bytes outside a step (mean over "
          "ranks, max), pred T/r (root, per_layer) or T (replicate); gathered = the most tower "
          "bytes FSDP2 held unsharded at once (pred T, B, 0); all-gathered = tower bytes "
          "all-gathered per step, in forward and in backward (pred T, T, 0 and none in "
          "backward); units = FSDP2 groups holding tower parameters")
    print(f"{'policy':<10} {'ranks':>5} {'sharded KiB':>11} {'max':>7} {'pred':>7} "
          f"{'gathered KiB':>12} {'pred':>7} {'AG fwd KiB':>10} {'AG bwd KiB':>10} {'pred':>7} "
          f"{'units':>5}")
    for row in rows:
        pr = row["predicted"]
        print(f"{row['policy']:<10} {row['ranks']:>5} {row['tower_bytes_mean'] / KiB:>11.0f} "
              f"{row['tower_bytes_max'] / KiB:>7.0f} {pr['tower_bytes'] / KiB:>7.0f} "
              f"{row['gathered_max_bytes'] / KiB:>12.0f} {pr['gathered_bytes'] / KiB:>7.0f} "
              f"{row['all_gathered_forward_bytes'] / KiB:>10.0f} "
              f"{row['all_gathered_backward_bytes'] / KiB:>10.0f} "
              f"{pr['all_gathered_forward_bytes'] / KiB:>7.0f} {row['tower_units']:>5}")
    print("\nresident memory (MiB, the largest rank): held = before step 1 (held-1st: minus the "
          "first policy's at the same ranks); peak = growth through a step above held; fwd = "
          "the same until the end of the model's forward, above what the rank held just "
          "before that step; step = the same through the whole step; top = held + peak, the "
          "resident peak; -repl: minus replicate's at the same ranks; pred: peak - replicate's "
          "predicted, T (root), B (per_layer), 0")
    print(f"{'policy':<10} {'ranks':>5} {'held':>5} {'held-1st':>8} {'peak':>5} {'-repl':>6} "
          f"{'pred':>5} {'fwd':>5} {'-repl':>6} {'step':>5} {'-repl':>6} {'top':>5} "
          f"{'-repl':>6}")
    for row in rows:
        pr = row["predicted"]
        print(f"{row['policy']:<10} {row['ranks']:>5} {row['held_bytes'] / MiB:>5.0f} "
              f"{row['held_minus_first_bytes'] / MiB:>+8.1f} {row['peak_bytes'] / MiB:>5.1f} "
              f"{row['peak_minus_replicate_bytes'] / MiB:>+6.1f} "
              f"{pr['peak_minus_replicate_bytes'] / MiB:>5.1f} "
              f"{row['forward_peak_bytes'] / MiB:>5.1f} "
              f"{row['forward_minus_replicate_bytes'] / MiB:>+6.1f} "
              f"{row['step_peak_bytes'] / MiB:>5.1f} "
              f"{row['step_minus_replicate_bytes'] / MiB:>+6.1f} "
              f"{row['top_bytes'] / MiB:>5.0f} {row['top_minus_replicate_bytes'] / MiB:>+6.1f}")
    print("\ntok/s: median after the warmup (the whole step: data, train_step, optimizer); "
          "step s: the slowest rank's train_step wall time; cpu s: CPU seconds of a train_step, "
          "all ranks together; cpu x: over the first policy's at the same ranks; loss and "
          "gradient-norm differences: the largest relative one from the first run's, over all "
          "steps")
    print(f"{'policy':<10} {'ranks':>5} {'tok/s':>6} {'step s':>6} {'cpu s':>6} {'cpu x':>6} "
          f"{'final loss':>10} {'loss rel d':>10} {'gnorm rel d':>11}")
    for row in rows:
        over = "*" if row["ranks"] * args.threads > cores else " "
        print(f"{row['policy']:<10} {row['ranks']:>5} {row['tokens_per_second']:>6.0f}{over}"
              f"{row['step_wall_s']:>6.2f} {row['step_cpu_s']:>6.2f} {row['cpu_ratio']:>6.2f} "
              f"{row['losses'][-1]:>10.6f} "
              f"{row['loss_max_rel_diff']:>10.1e} {row['grad_norm_max_rel_diff']:>11.1e}")
    if any(r["ranks"] * args.threads > cores for r in rows):
        print(f"* more rank threads than the {cores} cores: compare wall-clock numbers only at "
              "equal ranks")
    finish(ok, f"{first['policy']} on {first['ranks']} ranks", LOSS_RTOL, args, rows)


if __name__ == "__main__":
    main()
