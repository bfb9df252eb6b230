"""What a plan assumed that the run may do differently (``plan.json``'s ``notes``): where the
simulation stands in for the job's own behaviour, and what the numbers leave out."""

from __future__ import annotations

from automodel.config.resolve import TrainConfig
from automodel.planning.strategies import STAND_IN_NOTES


def _optimizer_note(cfg: TrainConfig) -> str:
    if cfg.optim.foreach:
        return ("AdamW simulated on its multi-tensor path (optim.foreach: a GPU's default), "
                "its temporaries (about one state's size) counted in the optimizer step's peak; "
                "freed after the step, the CUDA caching allocator keeps their blocks reserved, "
                "so the reserved memory that nvidia-smi shows stays near peak + overhead")
    return ("AdamW simulated one parameter at a time (optim.foreach false, or the CPU's "
            "default): its temporaries are one parameter's")


def profile_notes(gpu: dict, calibration) -> list[str]:
    """What a plan or a search on the GPU profile ``gpu`` (its ``as_dict``) should say of its
    default efficiency: where no published bf16 run of that GPU supports it, how it was found
    (unless ``calibration`` sets it)."""
    from automodel.costing.gpus import CARRIED_OVER

    name = gpu["name"]
    if name not in CARRIED_OVER or "compute_efficiency" in calibration:
        return []
    return [f"{name}: no published bf16 training run on it was found; its compute_efficiency "
            f"({gpu['compute_efficiency']}) is {CARRIED_OVER[name]}: calibrate it from a run "
            "(plan.calibrate_from=RUN_DIR, or plan.calibration.compute_efficiency)"]


def plan_notes(cfg: TrainConfig, plan: dict) -> list[str]:
    notes = [
        "the step simulated is a steady one (the optimizer's states made first, as step 1 "
        "makes them); a run's first step can peak higher (one-off allocations)",
        "memory is live tensor bytes; the CUDA context, NCCL's buffers, library workspaces "
        "and the allocator's fragmentation are the stated overhead_bytes (the GPU profile's "
        "overhead_bytes + overhead_fraction x peak), not simulated",
        "step_time_s is the cost model's (docs/planning.md): no per-collective latency, no "
        "slowdown of compute by concurrent communication, no host-device copies",
        _optimizer_note(cfg),
    ]
    notes += profile_notes(plan["gpu"], plan["calibration"])
    if getattr(cfg.parallelism, "enable_compile", False):
        notes.append("parallelism.enable_compile=true: simulated in eager mode; compiled "
                     "blocks fuse kernels, which can hold fewer activation and temporary "
                     "bytes and run faster than compute_efficiency assumes")
    if cfg.strategy.name in STAND_IN_NOTES:  # (a wrap the planner stands in for)
        notes.append(STAND_IN_NOTES[cfg.strategy.name])
    if cfg.layout.ep > 1:
        notes.append(f"mesh.ep_size={cfg.layout.ep}: routing simulated balanced (each expert "
                     "receives tokens x top_k / num_experts); a real router sends its busiest "
                     "expert more: more all-to-all bytes and memory on that expert's rank")
    if cfg.cpu_offload:
        notes.append("parallelism.offload_policy (CPU offload): peak_bytes is device memory; "
                     "host_bytes is the host's (sharded parameters, reduced gradients, the "
                     "optimizer's states and step); the copies between them and the "
                     "optimizer's step on the CPU are not in step_time_s")
    if cfg.data_source != "synthetic":
        notes.append(f"data={cfg.data_source} is not read: the plan trains on rows of "
                     f"trainer.seq_len={cfg.trainer.seq_len} tokens of the configured batch "
                     "shapes; shorter rows or other image counts change activation memory")
    if any(r["count"] > 1 for r in plan["ranks"]):
        notes.append("each rank class is simulated on its example_rank; its other ranks hold "
                     "equal shares (where FSDP's shards are uneven, the example's is the "
                     "larger)")
    return notes
