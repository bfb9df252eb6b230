"""One rank of a job, simulated in this process: automodel's own code on fake tensors.

For rank ``r`` of a world of ``N``: a fake process group of ``N`` ranks (collectives return at
once and move nothing), automodel's mesh on it, the model built on the meta device, automodel's
``parallelize`` with ``to_empty`` under ``FakeTensorMode`` as the materialization (shapes,
dtypes and placements are real; no byte is allocated), the real optimizer and the real step
(``train_step`` or the pipeline's ``PipelineStep``) on host batches of the configured shapes.

The optimizer's states are made first, as its first step would make them (one step on zero
gradients, not reported: a first step's peak holds one-off allocations). Then one training
step runs under torch's memory tracker (live tensor bytes by kind, their peak), a collective
counter (``costing/comm.py``) and a FLOP counter (``costing/flops.py``): the steady state,
as the second and later steps of a run. (On layouts of every kind the peak equals that of a
second step after a real first one, at half the time.)
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from automodel.compat.planning import (
    fake_store,
    fake_tensor_mode,
    grouped_mm_in_any_float,
    memory_tracker,
    offloaded_parameters,
    optimizer_peak_bytes,
    peak_snapshots,
    pipeline_warmup_without_peers,
    sends_held_until_waited,
    sharding_propagation_marked,
    split_backward_tracked,
    value_checks_pass_on_fake_tensors,
)
from automodel.compat.torch_dist import forget_meshes
from automodel.config.resolve import TrainConfig
from automodel.costing.comm import CommCounter, axis_groups
from automodel.costing.counters import StepCounters
from automodel.costing.flops import FlopCounter
from automodel.planning.fake import IndicesStayReal, RealStaysReal, allocate_fake

# the memory tracker's kinds -> the plan's categories
CATEGORIES = {"Parameter": "parameters_sharded", "Gradient": "gradients",
              "Optstate": "optimizer_states", "Activation": "activations",
              "Temp": "temporary", "Buffer": "other", "Other": "other"}
MEMORY_KEYS = ("parameters_sharded", "parameters_unsharded", "gradients", "optimizer_states",
               "activations", "temporary", "other")


@dataclass
class RankSimulation:
    rank: int
    stages: list  # pipeline stage ids this rank holds ([0] without a pipeline)
    peak_bytes: int  # live tensor bytes at the peak of the second step
    memory: dict  # the peak split by MEMORY_KEYS
    detail: dict  # the tracker's own kinds at the peak (all-gather, reduce-scatter, ...)
    comm: dict  # mesh axis -> collective kind -> bytes of one step
    flops: int  # FLOPs of one step on this rank (forward, backward, recomputation)
    recv_buffer_bytes: int = 0  # the pipeline's pooled receive buffers
    comm_calls: dict = dataclasses.field(default_factory=dict)  # axis -> kind -> collectives
    # CPU offload: the host memory's peak and its split (sharded parameters, their reduced
    # gradients, the optimizer's states and step); peak_bytes is then the device's alone
    host_bytes: int = 0
    host_memory: dict = dataclasses.field(default_factory=dict)
    combined_peak_bytes: int = 0  # the peak of device and host memory together
    optimizer_peak_bytes: int = 0  # the device's peak while the optimizer steps
    # of the state kept between steps (parameter shards and optimizer states), the experts'
    # (mixture-of-experts models): FSDP pads their expert dimension to its shard count
    expert_state_bytes: int = 0


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """A fake default process group: this process is ``rank`` of ``world_size``."""
    if dist.is_initialized():
        raise RuntimeError("simulate_rank needs a process without a process group")
    try:  # (an interruption inside init_process_group too leaves no group behind)
        dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_meshes()  # (the next simulation in this process builds meshes of its own)


def simulate_rank(cfg: TrainConfig, rank: int) -> RankSimulation:
    """Build and run ``cfg``'s job as its rank ``rank`` would, on fake tensors."""
    with fake_job(cfg, rank) as (job, batches, mesh):
        return _measure(job, batches(1), rank, axis_groups(mesh))


def fake_step(cfg: TrainConfig, rank: int) -> None:
    """One training step of ``cfg``'s rank ``rank`` on fake tensors, nothing measured (the
    preflight's check, ``checks/fake_step.py``). An exception in the model's forward is
    raised as ``ModuleFailed``, naming the innermost module that was running."""
    from automodel.planning.fake import ModuleTrail

    with fake_job(cfg, rank) as (job, batches, _):
        with ModuleTrail(job.parallel.parts):
            job.step(batches(0))


@contextlib.contextmanager
def fake_job(cfg: TrainConfig, rank: int):
    """``cfg``'s job built as its rank ``rank`` builds it, in a fake world of the job's size
    on fake tensors: yields (the job, ``step -> micro-batches``, the mesh) inside the fake
    mode."""
    from automodel.distributed.init import DistInfo
    from automodel.distributed.mesh import build_mesh_for
    from automodel.planning.batches import planning_batches
    from automodel.recipes.train import build_setup

    cpu = torch.device("cpu")
    cfg = eager(static_stage_shapes(cfg))
    with fake_world(cfg.layout.world_size, rank):
        mesh = build_mesh_for(cfg.layout, "cpu", "fake", cfg.distributed.timeout_minutes)
        info = DistInfo("fake", cpu, rank, cfg.layout.world_size, rank)
        setup = build_setup(cfg, info, mesh)
        batches = planning_batches(cfg, setup)  # host tensors, made before the fake mode
        with fake_tensor_mode(), pipeline_warmup_without_peers(), sharding_propagation_marked(), \
                value_checks_pass_on_fake_tensors(), split_backward_tracked(), \
                grouped_mm_in_any_float(), sends_held_until_waited():
            with RealStaysReal():  # (the mesh's index arithmetic, while parallelizing)
                job = _build(cfg, setup)
            yield job, batches, mesh


def static_stage_shapes(cfg: TrainConfig) -> TrainConfig:
    """Pipeline stages learn their input shapes from their peers at run time unless
    ``pipeline.pp_seq_len`` states them; a simulated rank has no peers, so it states them
    (the same tensors either way)."""
    if cfg.pipeline is None or cfg.pipeline.pp_seq_len is not None:
        return cfg
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(
        cfg.pipeline, pp_seq_len=cfg.trainer.seq_len))


def eager(cfg: TrainConfig) -> TrainConfig:
    """``parallelism.enable_compile`` off: the planner simulates the eager step (fake tensors
    do not go through the compiler's kernels; ``planning/notes.py`` says so in the plan)."""
    if not getattr(cfg.parallelism, "enable_compile", False):
        return cfg
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism,
                                                                    enable_compile=False))


@dataclass
class _Job:
    parallel: object
    optimizer: object
    step: object  # callable(micro_batches): one training step with the optimizer's
    pipeline: object = None
    experts: list = dataclasses.field(default_factory=list)  # the experts modules


def _build(cfg: TrainConfig, setup) -> _Job:
    from automodel.models.experts import expert_modules
    from automodel.optim import Optimizers
    from automodel.parallelize import parallelize
    from automodel.peft import adapted_meta_model
    from automodel.planning.moe import balanced_routing
    from automodel.planning.strategies import planning_strategy
    from automodel.recipes.router_loss import RouterLoss
    from automodel.recipes.step import train_step

    model = adapted_meta_model(cfg)  # (peft: the adapters too; the base frozen)
    experts = list(expert_modules(model).values())  # (found by name before wrapping)
    router_loss = RouterLoss.of(model)
    setup.strategy = planning_strategy(setup.strategy)  # (DDP: a stand-in; refusals)
    parallel = parallelize(model, setup, allocate_fake)
    balanced_routing(parallel.parts)  # (expert parallelism: balanced all-to-alls)
    optimizer = Optimizers(parallel.parts, cfg.optim)
    if setup.strategy.wrap_optimizer is not None:
        parallel.parts[:] = setup.strategy.hook("wrap_optimizer")(parallel.parts, optimizer,
                                                                 setup)
    pipeline = None
    if setup.pp_enabled:
        from automodel.recipes.pipeline_step import PipelineStep

        pipeline = PipelineStep(parallel, setup,
                                cfg.layout.per_rank_batch(cfg.trainer.global_batch_size),
                                router_loss)
    clip = cfg.optim.max_grad_norm

    def step(micro):
        if pipeline is not None:
            pipeline(micro, clip)
        else:
            train_step(parallel.parts[0], setup, micro, clip, router_loss, parallel.head_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _Job(parallel, optimizer, step, pipeline, experts)


def _measure(job: _Job, micro, rank: int, axis_of: dict) -> RankSimulation:
    """The optimizer states made under the memory tracker (tracked from their creation on),
    then one training step under it again (a new peak) and the counters. Under CPU offload
    the tracker counts what FSDP keeps on the host apart."""
    parts = list(job.parallel.parts)
    host_params = offloaded_parameters(parts)
    tracker = memory_tracker(parts, list(job.optimizer.optimizers), host_params)
    # FSDP hands each reduced gradient to its sharded parameter, on the host under offload
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.move_to_host(p.grad))
             for p in host_params]
    with tracker:
        _make_optimizer_states(job)
    experts = expert_state_bytes(job.experts, job.optimizer.optimizers)
    counter, flops = CommCounter(axis_of), FlopCounter()
    with tracker, StepCounters(flops, counter), IndicesStayReal():
        job.step(micro)
    for h in hooks:
        h.remove()
    peaks = peak_snapshots(tracker)
    detail = peaks["device"]
    total = detail.pop("Total", 0)
    host_sharded = sum(_local_bytes(p) for p in host_params)
    memory = memory_split(detail, sharded_parameter_bytes(parts) - host_sharded)
    host = peaks["host"]
    host_total = host.pop("Total", 0)
    recv = job.pipeline.local_recv_buffer_bytes() if job.pipeline is not None else 0
    return RankSimulation(rank, list(job.parallel.stage_ids), total, memory, detail,
                          counter.result(), flops.total, recv, counter.call_counts(),
                          host_total, memory_split(host, host_sharded) if host else {},
                          peaks["all"].get("Total", 0), optimizer_peak_bytes(tracker),
                          experts)


def memory_split(detail: dict, sharded: int) -> dict:
    """The tracker's kinds at a peak as the plan's categories. Its parameters are those
    registered at the peak: under FSDP2 the gathered ones too, told apart by ``sharded``, the
    bytes of the shards kept in this memory between steps."""
    memory = dict.fromkeys(MEMORY_KEYS, 0)
    for kind, n in detail.items():
        memory[CATEGORIES[kind]] += n
    memory["parameters_unsharded"] = max(0, memory["parameters_sharded"] - sharded)
    memory["parameters_sharded"] -= memory["parameters_unsharded"]
    return memory


def _make_optimizer_states(job: _Job) -> None:
    """The optimizer's states, as its first step makes them: one step on zero gradients."""
    for opt in job.optimizer.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)


def expert_state_bytes(experts: list, optimizers) -> int:
    """This rank's bytes of the ``experts`` modules' parameter shards (of a pipeline stage's
    modules, those it holds) and their optimizer states."""
    params = {id(p): p for m in experts for p in m.parameters() if p.device.type != "meta"}
    states = sum(_local_bytes(t) for opt in optimizers for p, state in opt.state.items()
                 if id(p) in params for t in state.values() if isinstance(t, torch.Tensor))
    return sum(_local_bytes(p) for p in params.values()) + states


def sharded_parameter_bytes(parts: list) -> int:
    """Bytes of the parameters this rank keeps between steps (its shards)."""
    seen, n = set(), 0
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += _local_bytes(p)
    return n


def _local_bytes(p) -> int:
    from automodel.peft.nf4 import stored_bytes

    return stored_bytes(p)  # (this rank's shard; QLoRA's NF4 weights at their 4-bit size)


def as_dict(sim: RankSimulation) -> dict:
    return dataclasses.asdict(sim)
