"""The training runner, executed on every rank with the same resolved ``TrainConfig``.

build model -> parallelize -> optimizer, scheduler -> data plan -> loop -> metrics
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.profiler import record_function

from automodel.checkpoint.manager import Checkpointer, checkpoint_bytes, warn_if_short_of_space
from automodel.checkpoint.paths import checkpoint_root, complete_checkpoints
from automodel.config.resolve import TrainConfig
from automodel.data.batches import BatchPlan
from automodel.data.prefetch import Prefetcher
from automodel.data.sources import training_data
from automodel.distributed.context_parallel import build_context_parallel
from automodel.distributed.init import (
    DistInfo,
    destroy_distributed,
    init_distributed,
    set_collective_timeout,
)
from automodel.distributed.materialize import (
    full_initial_state,
    load_slices,
    materialize,
    names_match,
    safetensors_files,
)
from automodel.distributed.megatron_fsdp import apply_megatron_fsdp
from automodel.distributed.megatron_meta_init import ModuleSource
from automodel.distributed.mesh import MeshAxis, MeshContext, build_mesh
from automodel.distributed.patches import patch_is_packed_sequence
from automodel.distributed.setup import DistributedSetup, named_hook
from automodel.faults import Faults
from automodel.launch.errors import TrainingStopped
from automodel.launch.failure import set_phase
from automodel.launch.signals import StopSignal
from automodel.models.builder import build_meta_model, build_model
from automodel.optim import Optimizers, Schedulers
from automodel.parallelize import parallelize
from automodel.recipes.evaluate import Evaluator
from automodel.recipes.router_loss import RouterLoss
from automodel.recipes.step import train_step
from automodel.recipes.step_log import StepLog
from automodel.recipes.step_values import read_step
from automodel.tracking.profile import StepProfiler

log = logging.getLogger("automodel")


class LogFileHandler(logging.FileHandler):
    """``train.log``: a failed write (a full disk) is said once, naming the file and the
    cause, and training goes on (the console still has the log)."""

    failed = False

    def handleError(self, record) -> None:
        if self.failed:
            return
        self.failed = True
        err = sys.exc_info()[1]
        print(f"automodel: cannot write {self.baseFilename}: {type(err).__name__}: {err}; "
              "the log goes on only on the console", file=sys.stderr, flush=True)


def _setup_logging(output_dir: str, info: DistInfo) -> list[logging.Handler]:
    """Rank 0 logs to the console and ``train.log``; returns the handlers it added."""
    root = logging.getLogger()
    added: list[logging.Handler] = []
    if info.is_main:
        log_file = os.path.abspath(os.path.join(output_dir, "train.log"))
        if not any(getattr(h, "baseFilename", None) == log_file for h in root.handlers):
            os.makedirs(output_dir, exist_ok=True)
            fh = LogFileHandler(log_file)
            fh.setFormatter(logging.Formatter(
                "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
            added.append(fh)
        if not any(type(h) is logging.StreamHandler for h in root.handlers):
            added.append(logging.StreamHandler())
        for h in added:
            root.addHandler(h)
        root.setLevel(logging.INFO)
        # Rank 0 only reads the model output (no in-place ops), so this FSDP2 caution is noise.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    else:  # other ranks stay quiet unless something fails
        root.setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
    return added


def _agree_output_dir(output_dir: str, setup: DistributedSetup) -> str:
    """Under torchrun every rank composed its own config: the model's rank 0's dir wins."""
    if setup.dist.world_size > 1:
        box = [output_dir]
        dist.broadcast_object_list(box, group=setup.process_group, group_src=0)
        return box[0]
    return output_dir


def build_setup(cfg: TrainConfig, info: DistInfo, mesh: MeshContext | None = None
                ) -> DistributedSetup:
    """``mesh``: the model's mesh, built beforehand when the job holds other models on other
    ranks (see ``train``); by default one over every rank. ``setup.dist`` counts ranks within
    the mesh."""
    if mesh is not None:
        _check_mesh(cfg, mesh)
    elif dist.is_initialized():
        m = cfg.mesh
        # groups start with the start-up timeout; set_collective_timeout lowers it later
        mesh = build_mesh(info.device.type, info.backend,
                          info.startup_timeout.total_seconds() / 60,
                          pp=m.pp_size, dp_replicate=m.dp_replicate_size,
                          dp_shard=m.dp_size // m.dp_replicate_size, cp=m.cp_size, tp=m.tp_size,
                          cp_ulysses=m.cp_ulysses_size or 1, ep=m.ep_size)
    return DistributedSetup(
        strategy=cfg.strategy, options=cfg.parallelism,
        dist=info.within(None if mesh is None else mesh.group), mesh=mesh,
        activation_checkpointing=cfg.activation_checkpointing,
        activation_checkpointing_scope=cfg.activation_checkpointing_scope,
        mp_policy=cfg.mp_policy, offload_policy=cfg.offload_policy, pipeline=cfg.pipeline,
        cp=build_context_parallel(mesh),
        pre_shard_hook=named_hook(getattr(cfg.parallelism, "pre_shard_hook", None)),
        loss=cfg.trainer.loss, loss_chunk_tokens=cfg.trainer.loss_chunk_tokens)


def _check_mesh(cfg: TrainConfig, mesh: MeshContext) -> None:
    m = cfg.mesh
    want = {MeshAxis.PP: m.pp_size, MeshAxis.DP: m.dp_size, MeshAxis.CP: m.cp_size,
            MeshAxis.TP: m.tp_size}
    got = {axis: mesh.size(axis) for axis in want}
    if got != want or (m.ep_size > 1) != (mesh.moe is not None):
        raise ValueError(f"the mesh given to train() has {_sizes(got)} (expert parallelism "
                         f"{'on' if mesh.moe is not None else 'off'}); the config's mesh is "
                         f"{_sizes(want)} with ep_size={m.ep_size}: build the mesh from it")


def _sizes(sizes: dict) -> str:
    return ", ".join(f"{axis.value}={n}" for axis, n in sizes.items())


def train(cfg: TrainConfig, info: DistInfo, mesh: MeshContext | None = None) -> list[dict]:
    """Train on this rank. ``mesh``: when the job holds other models on other ranks (a frozen
    reference, a teacher), this model's mesh over its ranks only (``build_mesh(ranks=...)``,
    built by every rank of the job); only those ranks call ``train``. Its collectives stay
    inside the mesh's group and the model's first rank writes the files."""
    setup = build_setup(cfg, info, mesh)
    output_dir = _agree_output_dir(cfg.output_dir, setup)
    handlers = _setup_logging(output_dir, setup.dist)
    try:
        return _train(cfg, setup, output_dir)
    finally:
        for h in handlers:
            logging.getLogger().removeHandler(h)
            h.close()


def _train(cfg: TrainConfig, setup: DistributedSetup, output_dir: str) -> list[dict]:
    info = setup.dist  # ranks within the model's group
    group = setup.process_group  # every collective of the recipe's own runs on it
    if getattr(cfg.parallelism, "patch_is_packed_sequence", False):
        patch_is_packed_sequence()
    set_phase("model build")
    model, fill = _initial_model(cfg, info, group)
    n_params = sum(p.numel() for p in model.parameters())
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    model_config = model.config.to_dict()
    router_loss = RouterLoss.of(model)
    set_phase("parallelize")
    parallel = parallelize(model, setup, fill)
    model = parallel.parts[0]
    optimizer = Optimizers(parallel.parts, cfg.optim)
    if setup.strategy == "megatron_fsdp":  # wraps the model and the optimizer together
        parallel.parts[:] = apply_megatron_fsdp(parallel.parts, optimizer, setup)
        model = parallel.parts[0]
    scheduler = Schedulers(optimizer, cfg.optim, cfg.trainer.max_steps)
    t = cfg.trainer
    set_phase("data")
    rows, held_out = training_data(cfg.data_source, cfg.data, t.seq_len, cfg.model)
    plan = BatchPlan(rows, t.global_batch_size, t.seed)
    pipeline = None
    if setup.pp_enabled:  # (imported here: torch's pipelining pulls in the compiler stack)
        from automodel.recipes.pipeline_step import PipelineStep

        pipeline = PipelineStep(parallel, setup, t.global_batch_size // setup.dp_size,
                                router_loss)
    evaluator = (Evaluator(held_out, t, setup, pipeline, parallel.head_loss)
                 if held_out is not None and t.eval_every else None)
    micro = (f"{parallel.num_stages} pipeline stages, {pipeline.n_microbatches} micro-batches "
             "per schedule step" if pipeline is not None else
             f"{cfg.grad_accum_steps} micro-batch(es) per rank per step")
    log.info("automodel: %s on %d rank(s) (dp=%d, cp=%d, tp=%d, pp=%d), %s with %.2fM "
             "parameters, %d steps of %d x %d tokens, %s, %s; output in %s",
             cfg.strategy, info.world_size, setup.dp_size, setup.size(MeshAxis.CP),
             setup.size(MeshAxis.TP), setup.size(MeshAxis.PP),
             type(model).__name__, n_params / 1e6, t.max_steps, t.global_batch_size, t.seq_len,
             micro, info.describe(), output_dir)
    if n_frozen:
        log.info("model.freeze=%s: %.2fM of %.2fM parameters frozen (not in the optimizer)",
                 list(cfg.model.freeze), n_frozen / 1e6, n_params / 1e6)
    faults = Faults(info.rank)
    per_checkpoint = checkpoint_bytes(n_params, n_params - n_frozen,
                                      torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8)
    checkpointer = Checkpointer(checkpoint_root(cfg.checkpoint.dir, output_dir),
                                cfg.checkpoint.keep_last, info.rank, faults, per_checkpoint,
                                group)
    if info.is_main:
        warn_if_short_of_space(checkpointer.root, per_checkpoint, cfg.checkpoint, t.max_steps)
    set_phase("checkpoint load")
    start_step = _restore(cfg, checkpointer, parallel.parts, optimizer, scheduler)
    last_step = t.stop_at_step or t.max_steps
    steplog = StepLog(cfg, info, output_dir, start_step, last_step)
    saved_step, number, stopped_by = start_step, start_step, None
    stop = StopSignal().install()
    profiler = StepProfiler(t.profile_steps, output_dir, info.rank, info.is_main,
                            info.device.type)
    batches = Prefetcher(
        lambda step: plan.micro_batches(step, setup.dp_rank, setup.dp_size, t.local_batch_size),
        t.prefetch_steps, last_step, pin_memory=setup.device.type == "cuda")

    def save(step_number: int) -> None:
        nonlocal saved_step
        extra = {"tokenizer_path": getattr(cfg.data, "tokenizer_path", None)}
        with _startup_timeout(info, group):  # rank 0 exports and prunes alone
            set_phase(f"checkpoint save (step {step_number}, {checkpointer.path(step_number)})")
            path = checkpointer.save(step_number, parallel.parts, optimizer, scheduler,
                                     model_config, extra, export_hf=cfg.checkpoint.export_hf)
        saved_step = step_number
        log.info("checkpoint saved: %s", path)

    try:
        with steplog.logging_redirect():
            for step in range(start_step, last_step):
                number = step + 1
                set_phase(f"step {number}")
                faults.before_step(number)
                profiler.begin(number)
                started = time.perf_counter()
                lr = scheduler.get_last_lr()[0]
                micro = batches.get(step)
                hooks = faults.poison_logits(number, parallel.parts)
                if pipeline is not None:
                    stats = pipeline(micro, cfg.optim.max_grad_norm)
                else:
                    stats = train_step(model, setup, micro, cfg.optim.max_grad_norm,
                                       router_loss, parallel.head_loss)
                for h in hooks:
                    h.remove()
                # The step's one device-to-host read (loss, norm, tokens, peak memory, the stop
                # signal of any rank): the same values on every rank, so every rank takes the
                # same branches. Before the optimizer step, which a non-finite step never runs.
                values = read_step(stats, info, stop.received, group)
                if values.finite:
                    with record_function("automodel::optimizer"):
                        optimizer.step()
                else:
                    _nonfinite(number, values.loss, values.grad_norm, t.on_nonfinite, saved_step)
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                profiler.end(number)
                seconds = time.perf_counter() - started
                eval_loss = None
                if evaluator is not None and values.finite and evaluator.due(number):
                    set_phase(f"evaluation after step {number}")
                    eval_loss = evaluator(parallel.parts)
                    set_phase(f"step {number}")
                steplog.step(number, values, lr, seconds, plan.epochs(number), eval_loss)
                if step == start_step:  # start-up (compile, loads, W&B start) is over
                    set_collective_timeout(info.timeout, group)
                if cfg.checkpoint.every_steps and number % cfg.checkpoint.every_steps == 0:
                    save(number)
                stopped_by = values.stop_signal
                if stopped_by is not None and number < last_step:
                    break
                stopped_by = None  # (a signal during the last step: the run is done anyway)
        final = number == t.max_steps and (cfg.checkpoint.every_steps or cfg.checkpoint.export_hf)
        if saved_step != number and (stopped_by is not None or final):
            save(number)
    except BaseException:
        # a failing rank leaves at once: no collective here (its peers may be inside another
        # one, and it would wait out the timeout); the launcher stops them
        batches.close()
        stop.restore()
        steplog.close()
        raise
    else:
        batches.close()
        stop.restore()
        set_collective_timeout(info.startup_timeout, group)  # rank 0 alone finishes W&B
        steplog.close()
    if stopped_by is not None:
        stopped = TrainingStopped(stopped_by, number, checkpointer.path(number))
        log.warning("%s", stopped)
        if cfg.launch.kind == "slurm":
            if stop.hand_over_to_submitit():  # rank 0: submitit requeues the job
                log.warning("SLURM job requeued through submitit")
            if group is not None:  # no rank ends before the requeue is done
                dist.barrier(group=group)
        raise stopped
    return steplog.records


@contextlib.contextmanager
def _startup_timeout(info: DistInfo, group):
    set_collective_timeout(info.startup_timeout, group)
    try:
        yield
    finally:
        set_collective_timeout(info.timeout, group)


def _initial_model(cfg: TrainConfig, info: DistInfo, group=None):
    """(model, materialize). With a process group every rank builds the model on the meta
    device and ``parallelize`` materializes only its shards: read as slices from a pretrained
    safetensors checkpoint by every rank, or else filled from the first rank's full copy (from
    config with the seed, or another checkpoint format). A lone process builds the real model
    directly."""
    seed = cfg.trainer.seed
    if not dist.is_initialized():
        return build_model(cfg.model, seed).to(info.device), None
    model = build_meta_model(cfg.model)
    files = (safetensors_files(cfg.model.pretrained_path) if cfg.model.pretrained_path
             else None)
    if files is not None and not names_match(model, files):
        files = None  # stored under other names: rank 0 loads it with from_pretrained

    def fill(parts):
        if files is not None:
            load_slices(parts, info.device, files)
            torch.manual_seed(seed)  # (as build_model leaves it)
        else:
            materialize(parts, info.device, lambda: full_initial_state(cfg.model, seed),
                        group)

    # (parallelism.init_fsdp_with_meta_device: megatron-fsdp fills one module at a time)
    fill.source = ModuleSource(files, lambda: full_initial_state(cfg.model, seed), seed, group)
    return model, fill


def _nonfinite(number: int, loss: float, grad_norm: float, policy: str, saved_step: int):
    if policy == "raise":
        raise NonFiniteLoss(
            f"step {number}: loss={loss} grad_norm={grad_norm} is not finite; stopped "
            f"(trainer.on_nonfinite=raise). The last checkpoint is from step {saved_step}; "
            "lower optim.lr or set trainer.on_nonfinite=skip to drop such steps")
    log.warning("step %d: loss=%s grad_norm=%s is not finite: step skipped "
                "(trainer.on_nonfinite=skip), parameters unchanged", number, loss, grad_norm)


class NonFiniteLoss(RuntimeError):
    """trainer.on_nonfinite=raise and a step's loss or gradient norm was NaN or infinite."""


def _restore(cfg: TrainConfig, checkpointer: Checkpointer, parts, optimizer, scheduler) -> int:
    """Load the checkpoint ``checkpoint.resume`` names; returns the step to start from."""
    path = cfg.checkpoint.resume
    if path is None and cfg.launch.restarts > 0:
        log.info("SLURM requeued this job (restart %d): resuming from the latest checkpoint",
                 cfg.launch.restarts)
        path = "auto"
    if path == "auto":
        found = complete_checkpoints(checkpointer.root)
        path = found[-1] if found else None
        if path is None:
            log.info("checkpoint.resume=auto: no checkpoint in %s yet; starting at step 0",
                     checkpointer.root)
    if path is None:
        return 0
    step = checkpointer.load(path, parts, optimizer, scheduler)
    log.info("resumed from %s after step %d", path, step)
    return step


def run_rank(cfg: TrainConfig) -> list[dict] | None:
    """Entry point of one rank (local spawn, torchrun or in-process). Rank 0 returns records."""
    threads = os.environ.get("AUTOMODEL_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    set_phase("process group start")
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_minutes,
                            startup_timeout_minutes=cfg.distributed.startup_timeout_minutes,
                            need_group=cfg.strategy != "none")
    try:
        records = train(cfg, info)
        if dist.is_initialized():
            dist.barrier()
        return records if info.is_main else None
    finally:
        destroy_distributed()
