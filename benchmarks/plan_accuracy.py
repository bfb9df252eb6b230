"""The plan against the run: memory, communication and bubble, layout by layout (issue 27).

For each layout below, one real job on gloo ranks (``automodel.api.run``, as ``train.py``;
3 steps of 8 x 32 tokens on synthetic data, ``trainer.track_tensor_memory=true``,
``trainer.profile_steps=[3,3]``) and the plan of the same overrides, resolved as ``plan.py``
resolves them (its rank classes simulated in this process). Compared:

- memory: each rank class's planned ``peak_bytes`` against ``peak_tensor_bytes_by_rank`` of
  its example rank and of every rank of the class, at steps 2 and 3 (the steady state; step 1
  makes the optimizer's states);
- communication: the class's planned bytes per mesh axis and collective kind against those
  counted in the example rank's trace of step 3 (``planning/measured.py``; step 2 still
  has one-off traffic: DDP broadcasts its rebuilt buckets' order then);
- bubble: the plan's against ``bubble_of_run`` of the schedule object the run built and ran
  (recorded in each rank by ``parallelism.pre_shard_hook=benchmarks.plan_accuracy.
  record_schedule``, which changes nothing in the model), and each rank's compute calls
  against that object's order.

    python benchmarks/plan_accuracy.py                     # every layout, ~4 minutes
    python benchmarks/plan_accuracy.py --layouts fsdp2 pp_1f1b --json out.json --details

It prints a markdown table (docs/planning.md, "Accuracy").
"""

from __future__ import annotations

# Only cheap imports at module level: the ranks import this file (the schedule hook).
import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = 3
MEASURED_FROM = 2  # the first step whose peak is the steady state
COMMON = ["data=synthetic", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
          "trainer.global_batch_size=8", "trainer.seq_len=32", "optim.warmup_steps=0",
          "trainer.track_tensor_memory=true", "trainer.profile_steps=[3,3]",
          "distributed.backend=gloo"]
SCHEDULE_ENV = "AUTOMODEL_PLAN_ACCURACY_DIR"  # where ranks write the schedule they ran
HOOK = "parallelism.pre_shard_hook=benchmarks.plan_accuracy.record_schedule"
FSDP2_DP2 = ["parallelism=fsdp2", "mesh.dp_size=2"]
PP2 = ["parallelism=fsdp2", "mesh.dp_size=1", "mesh.pp_size=2",  # 4 micro-batches of 2
       "pipeline.pp_microbatch_size=2", HOOK]
# llama_tiny unless named; FSDP2's default mixed precision (bf16 compute, fp32 reduce)
LAYOUTS = {
    "ddp": ["parallelism=ddp", "mesh.dp_size=2"],
    "fsdp2": FSDP2_DP2,
    "hsdp": ["parallelism=hsdp", "mesh.dp_size=4", "mesh.dp_replicate_size=2"],
    "tp2_sp": ["parallelism=fsdp2", "mesh.dp_size=1", "mesh.tp_size=2",
               "parallelism.sequence_parallel=true"],
    "cp2": ["parallelism=fsdp2", "mesh.dp_size=1", "mesh.cp_size=2"],
    "pp_1f1b": [*PP2, "pipeline=1f1b"],
    "pp_interleaved": [*PP2, "pipeline=interleaved"],  # (2 stages of 2 layers per rank)
    "ep2": ["model=qwen3_moe_tiny", *FSDP2_DP2, "mesh.ep_size=2"],
    "ac_full": [*FSDP2_DP2, "parallelism.activation_checkpointing=full"],
    "ac_selective": [*FSDP2_DP2, "parallelism.activation_checkpointing=selective"],
    "cpu_offload": [*FSDP2_DP2, "parallelism.offload_policy={_target_:"
                    "torch.distributed.fsdp.CPUOffloadPolicy}"],
    "image_text_frozen": ["model=llava_tiny", *FSDP2_DP2, "model.freeze=[vision]"],
    # an image-text model's own layouts: the tower whole on each TP rank, the merged sequence
    # split over cp ranks, the tower on the first stage (a blank image where a micro-batch has
    # none); llava_tiny: the planner cannot simulate positions made from the images (Qwen2-VL)
    "image_text_tp2_sp": ["model=llava_tiny", "parallelism=fsdp2", "mesh.dp_size=1",
                          "mesh.tp_size=2", "parallelism.sequence_parallel=true"],
    "image_text_cp2": ["model=llava_tiny", "parallelism=fsdp2", "mesh.dp_size=1",
                       "mesh.cp_size=2"],
    "image_text_pp_1f1b": ["model=llava_tiny", *PP2, "pipeline=1f1b", "data.image_every=2"],
    # LoRA adapters: a frozen base (no gradients, no optimizer states) in three layouts
    "lora_fsdp2": [*FSDP2_DP2, "peft=lora"],
    "lora_tp2_sp": ["parallelism=fsdp2", "mesh.dp_size=1", "mesh.tp_size=2",
                    "parallelism.sequence_parallel=true", "peft=lora"],
    "lora_pp_1f1b": [*PP2, "pipeline=1f1b", "peft=lora"],
}


# ------------------------------------------------------------------ in the ranks (the hook)
def record_schedule(part) -> None:
    """``parallelism.pre_shard_hook``: in this rank, make each ``PipelineStep`` write, after
    its first step, the bubble of its schedule object and the compute calls it ran."""
    from automodel.recipes.pipeline_step import PipelineStep

    if getattr(PipelineStep, "_records_schedule", False):
        return
    original = PipelineStep.__call__

    def call(self, *args, **kwargs):
        first = not hasattr(self, "_ran")
        if first:
            self._ran = []
            _log_compute_calls(self, self._ran)
        out = original(self, *args, **kwargs)
        if first:
            _write_schedule(self)
        return out

    PipelineStep.__call__ = call
    PipelineStep._records_schedule = True


def _log_compute_calls(step, log: list) -> None:
    from automodel.compat import stages_of

    record_compute_calls(stages_of(step.schedule), log)


def record_compute_calls(stages, log: list) -> None:
    """Log each compute call of these ``PipelineStage`` objects as (kind, stage, mb)."""
    for stage in stages:
        fwd, bwd, wgt = (stage.forward_one_chunk, stage.backward_one_chunk,
                         stage.backward_weight_one_chunk)

        def forward(mb, *a, _s=stage.stage_index, _f=fwd, **k):
            log.append(("F", _s, mb))
            return _f(mb, *a, **k)

        def backward(mb, *a, _s=stage.stage_index, _f=bwd, **k):
            log.append(("B" if k.get("full_backward", True) else "I", _s, mb))
            return _f(mb, *a, **k)

        def weight(mb, *a, _s=stage.stage_index, _f=wgt, **k):
            log.append(("W", _s, mb))
            return _f(mb, *a, **k)

        stage.forward_one_chunk, stage.backward_one_chunk = forward, backward
        stage.backward_weight_one_chunk = weight


def _write_schedule(step) -> None:
    import torch.distributed as dist

    from automodel.distributed.pipelining.bubble import bubble_of_run, timeline_of_run

    rank = dist.get_rank(step.pp_group)
    timeline = timeline_of_run(step.schedule)
    out = {"bubble": bubble_of_run(step.schedule), "ran": step._ran,
           "order": [(b.kind, b.stage, b.microbatch) for b in timeline.ranks[rank]],
           "schedule": type(step.schedule).__name__, "microbatches": step.n_microbatches}
    path = os.path.join(os.environ[SCHEDULE_ENV], f"schedule_rank{dist.get_rank()}.json")
    with open(path, "w") as f:
        json.dump(out, f)


# ------------------------------------------------------------------ in this process
def plan_of(overrides: list, output_dir: str):
    """(the ``TrainConfig`` as ``plan.py`` resolves it, the plan). The rank classes are
    simulated in this process, one after the other (where it holds no process group)."""
    import torch.distributed as dist

    from automodel.api import load_config
    from automodel.config.plan_schema import PlanConfig
    from automodel.costing.gpus import profile
    from automodel.planning.job_env import planning_env
    from automodel.planning.plan import make_plan, rank_classes, simulate_classes
    from automodel.planning.simulate import as_dict, simulate_rank

    probe = load_config(overrides, output_dir)
    cfg = load_config(overrides, output_dir,
                      env=planning_env(PlanConfig(), probe.layout.dp))
    classes = rank_classes(cfg)
    if dist.is_initialized():  # (a process group here already: each class in a process)
        sims = simulate_classes(cfg, classes)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (FSDP2's view-output caution, every forward)
            sims = [as_dict(simulate_rank(cfg, c.rank)) for c in classes]
    return cfg, make_plan(cfg, profile(PlanConfig().gpu), simulations=sims)


def measure_layout(name: str, output_dir: str, overrides: list | None = None) -> dict:
    """Run layout ``name`` for real into ``output_dir``, plan it, and set the two side by
    side (``compare``)."""
    from automodel.api import run

    overrides = COMMON + list(LAYOUTS[name] if overrides is None else overrides)
    os.makedirs(output_dir, exist_ok=True)
    os.environ[SCHEDULE_ENV] = output_dir
    records = run(overrides, output_dir=output_dir)  # (rank 0's records of this run)
    cfg, plan = plan_of(overrides, output_dir)
    return compare(name, cfg, plan, records, output_dir)


def compare(name: str, cfg, plan: dict, records: list, output_dir: str) -> dict:
    from automodel.planning.measured import comm_bytes_by_axis

    steady = [r for r in records if r["step"] >= MEASURED_FROM]
    per_stage = cfg.layout.per_stage
    ranks = []
    for c in plan["ranks"]:
        example = c["example_rank"]
        members = [r for r in range(cfg.layout.world_size)
                   if r // per_stage == example // per_stage]
        measured = {r: [s["peak_tensor_bytes_by_rank"][r] for s in steady] for r in members}
        comm = comm_bytes_by_axis(
            os.path.join(output_dir, "profile", f"trace_rank{example}.json"), cfg.layout)
        m = max(measured[example])
        # a CPU run keeps the device's and the host's tensors (CPU offload) in one memory
        predicted = c["peak_bytes_device_and_host"]
        ranks.append({"name": c["name"], "example_rank": example, "ranks": members,
                      "predicted": predicted, "measured": m,
                      "device_peak": c["peak_bytes"], "host_peak": c["host_bytes"],
                      "measured_by_rank": measured,
                      "error": (predicted - m) / m,
                      "worst_error": max(abs(predicted - b) / b
                                         for bs in measured.values() for b in bs),
                      "memory": c["memory"], "detail": c["memory_detail"],
                      "comm_planned": c["comm_bytes_per_step"], "comm_measured": comm})
    every = [comm_bytes_by_axis(os.path.join(output_dir, "profile", f"trace_rank{r}.json"),
                                cfg.layout) for r in range(cfg.layout.world_size)]
    for r in ranks:
        r["comm_exact"] = comm_agrees(r["comm_planned"], [every[m] for m in r["ranks"]])
    return {"layout": name, "overrides": LAYOUTS.get(name), "ranks": ranks,
            "layout_sizes": {"world_size": cfg.layout.world_size, "pp": cfg.layout.pp},
            "comm_all_ranks": every,
            "bubble_planned": plan["bubble"], "schedules": _schedules_ran(output_dir)}


def comm_agrees(planned: dict, measured: list) -> bool:
    """Whether the planned bytes of a rank class are those measured on each of its ranks
    (``measured``, the example rank first). Expert parallelism's all-to-all carries what the
    router chose, which the plan simulates balanced: it is compared summed over the ranks,
    where routing cancels out (each rank sends its tokens x top_k, and back what it got)."""
    routed = "all_to_all" in planned.get("ep", {})

    def fixed(comm: dict) -> dict:
        return {a: {k: n for k, n in kinds.items() if not (routed and (a, k) == (
            "ep", "all_to_all"))} for a, kinds in comm.items()}

    if routed and sum(m.get("ep", {}).get("all_to_all", 0) for m in measured) != \
            len(measured) * planned["ep"]["all_to_all"]:
        return False
    return all(fixed(m) == fixed(planned) for m in (measured if routed else measured[:1]))


def _schedules_ran(output_dir: str) -> dict:
    """rank -> what ``record_schedule`` wrote there (empty without a pipeline)."""
    out = {}
    for f in sorted(Path(output_dir).glob("schedule_rank*.json")):
        out[int(f.stem[len("schedule_rank"):])] = json.loads(f.read_text())
    return out


def bubble_ran(result: dict) -> float | None:
    """The bubble of the schedule the run ran (the same object on every rank), or None."""
    values = {s["bubble"] for s in result["schedules"].values()}
    if len(values) > 1:
        raise ValueError(f"{result['layout']}: the ranks' schedules differ: {values}")
    return values.pop() if values else None


def table(results: list) -> str:
    """The accuracy table, in markdown."""
    lines = ["| layout | rank class | predicted (bytes) | measured (bytes) | error | "
             "comm exact | bubble planned / ran |", "|---|---|---|---|---|---|---|"]
    for res in results:
        ran = bubble_ran(res)
        bubble = "-" if ran is None else f"{res['bubble_planned']:.4f} / {ran:.4f}"
        for r in res["ranks"]:
            lines.append(f"| {res['layout']} | {r['name']} (rank {r['example_rank']}) | "
                         f"{r['predicted']:,} | {r['measured']:,} | {100 * r['error']:+.2f}% "
                         f"| {'yes' if r['comm_exact'] else 'no'} | {bubble} |")
    return "\n".join(lines)


def details(res: dict) -> str:
    """What a layout's plan and run said, for reading a disagreement."""
    out = [f"## {res['layout']}"]
    for r in res["ranks"]:
        out += [f"{r['name']}: predicted {r['predicted']:,}, measured by rank "
                f"{r['measured_by_rank']}", f"  plan memory {r['memory']}",
                f"  tracker kinds {r['detail']}",
                f"  comm planned  {r['comm_planned']}", f"  comm measured {r['comm_measured']}"]
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--json", help="also write every number here")
    p.add_argument("--details", action="store_true", help="print each plan's categories")
    p.add_argument("--output-dir", help="keep the runs here (default: a temporary folder)")
    args = p.parse_args(argv)
    root = args.output_dir or tempfile.mkdtemp(prefix="plan-accuracy-")
    results = []
    for name in args.layouts:
        results.append(measure_layout(name, os.path.join(root, name)))
        if args.details:
            print(details(results[-1]), flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
