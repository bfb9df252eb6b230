"""What a run trains with, built in order on every rank: the model (on the meta device under a
process group), its parallel form, the optimizer and scheduler, the data plan, the pipeline
schedule, the evaluator and the checkpointer; then the checkpoint to resume from is loaded.

The recipe (``recipes/train.py``) calls ``build_components`` and ``restore``; the step loop
(``recipes/loop.py``) runs on what they return.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from automodel.checkpoint.manager import Checkpointer, checkpoint_bytes, warn_if_short_of_space
from automodel.checkpoint.paths import checkpoint_root, complete_checkpoints, step_of
from automodel.config.enums import AsyncMode
from automodel.config.resolve import TrainConfig
from automodel.config.validate import LOAD_PARTS
from automodel.data.batches import BatchPlan
from automodel.data.sources import training_data
from automodel.distributed.init import DistInfo, new_group_with_own_timeout
from automodel.distributed.materialize import (
    full_initial_state,
    load_slices,
    materialize,
    names_match,
)
from automodel.distributed.megatron_meta_init import ModuleSource
from automodel.distributed.mesh import MeshAxis
from automodel.distributed.setup import DistributedSetup
from automodel.faults import Faults
from automodel.models.builder import build_meta_model, build_model
from automodel.models.weight_files import safetensors_files
from automodel.optim import Optimizers, Schedulers
from automodel.parallelize import ModelParts, parallelize
from automodel.peft import add_adapters, init_adapters, uses_adapters
from automodel.peft.experts import expert_targets
from automodel.peft.export import adapter_record
from automodel.peft.lora import LoraConv1D, lora_modules
from automodel.recipes.evaluate import Evaluator
from automodel.recipes.router_loss import RouterLoss
from automodel.runtime.attempts import in_job_restart
from automodel.runtime.failure import set_phase

log = logging.getLogger("automodel")


@dataclass
class Components:
    """Everything the step loop needs, built once per run."""

    parallel: ModelParts  # the model's parts on this rank (one, or this rank's pipeline stages)
    model: torch.nn.Module  # parallel.parts[0]
    optimizer: Optimizers
    scheduler: Schedulers
    router_loss: RouterLoss | None
    plan: BatchPlan
    pipeline: object | None  # a PipelineStep under pipeline parallelism
    evaluator: Evaluator | None
    faults: Faults
    checkpointer: Checkpointer
    model_config: dict  # the model's HF config, saved with every checkpoint
    adapters: dict | None  # the adapters and their base (peft; trainer.json of checkpoints)


def build_components(cfg: TrainConfig, setup: DistributedSetup, output_dir: str) -> Components:
    """Build the model, its parallel form, optimizer, scheduler, data, pipeline, evaluator and
    checkpointer, and log what the run is (the first lines of ``train.log``)."""
    info, group = setup.dist, setup.process_group
    set_phase("model build")
    model, fill = initial_model(cfg, info, group)
    n_params = sum(p.numel() for p in model.parameters())
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    model_config = model.config.to_dict()
    lora = lora_modules(model)  # (the whole model's, before a pipeline splits it)
    adapters = (adapter_record(cfg.peft, sorted(lora), cfg.model, cfg.trainer.seed,
                               expert_targets(model),
                               [n for n, m in lora.items() if isinstance(m, LoraConv1D)])
                if lora else None)
    router_loss = RouterLoss.of(model)
    set_phase("parallelize")
    parallel = parallelize(model, setup, fill)
    optimizer = Optimizers(parallel.parts, cfg.optim)
    if setup.strategy.wrap_optimizer is not None:  # (megatron_fsdp: model and optimizer)
        parallel.parts[:] = setup.strategy.hook("wrap_optimizer")(parallel.parts, optimizer, setup)
    model = parallel.parts[0]
    scheduler = Schedulers(optimizer, cfg.optim, cfg.trainer.max_steps)
    plan, pipeline, evaluator = _data(cfg, setup, parallel, router_loss)
    _log_run(cfg, setup, model, pipeline, parallel.num_stages, n_params, n_frozen, output_dir)
    faults = Faults(info.rank)
    checkpointer = _checkpointer(cfg, info, group, faults, output_dir, n_params, n_frozen)
    return Components(parallel, model, optimizer, scheduler, router_loss, plan, pipeline,
                      evaluator, faults, checkpointer, model_config, adapters)


def _data(cfg: TrainConfig, setup: DistributedSetup, parallel: ModelParts,
          router_loss: RouterLoss | None):
    """(the batch plan, the pipeline step or None, the evaluator or None)."""
    t = cfg.trainer
    set_phase("data")
    if hasattr(cfg.data, "tokenizer_path"):
        log.info("data=%s: tokenizer %s", cfg.data_source,
                 cfg.data.tokenizer_path or "none (byte-level tokens; data.tokenizer_path=null)")
    rows, held_out = training_data(cfg.data_source, cfg.data, t.seq_len, cfg.model)
    plan = BatchPlan(rows, t.global_batch_size, t.seed)
    pipeline = None
    if setup.pp_enabled:  # (imported here: torch's pipelining pulls in the compiler stack)
        from automodel.recipes.pipeline_step import PipelineStep

        pipeline = PipelineStep(parallel, setup, cfg.layout.per_rank_batch(t.global_batch_size),
                                router_loss)
    evaluator = (Evaluator(held_out, t, setup, pipeline, parallel.head_loss)
                 if held_out is not None and t.eval_every else None)
    return plan, pipeline, evaluator


def _log_run(cfg: TrainConfig, setup: DistributedSetup, model, pipeline, num_stages: int,
             n_params: int, n_frozen: int, output_dir: str) -> None:
    """The run's first log line (strategy, ranks, layout, model, steps, output), and the
    frozen parameters if any."""
    t, info = cfg.trainer, setup.dist
    micro = (f"{num_stages} pipeline stages, {pipeline.n_microbatches} micro-batches "
             "per schedule step" if pipeline is not None else
             f"{cfg.grad_accum_steps} micro-batch(es) per rank per step")
    lay = cfg.layout
    more = (f"; dp_replicate={lay.dp_replicate} x dp_shard={lay.dp_shard}"
            if lay.dp_replicate > 1 else "") + (f"; ep={lay.ep}" if lay.ep > 1 else "")
    log.info("automodel: %s on %d rank(s) (dp=%d, cp=%d, tp=%d, pp=%d%s), %s with %.2fM "
             "parameters, %d steps of %d x %d tokens, %s, %s; output in %s",
             cfg.strategy.name, info.world_size, setup.dp_size, setup.size(MeshAxis.CP),
             setup.size(MeshAxis.TP), setup.size(MeshAxis.PP), more,
             type(model).__name__, n_params / 1e6, t.max_steps, t.global_batch_size, t.seq_len,
             micro, info.describe(), output_dir)
    if uses_adapters(cfg.peft):
        p = cfg.peft
        log.info("peft=%s: adapters of rank %d (alpha %g) on %d linear layers; %.3fM of %.2fM "
                 "parameters train, the base's are frozen (not in the optimizer)", p.method,
                 p.rank, p.alpha, len(lora_modules(model)), (n_params - n_frozen) / 1e6,
                 n_params / 1e6)
    elif n_frozen:
        log.info("model.freeze=%s: %.2fM of %.2fM parameters frozen (not in the optimizer)",
                 list(cfg.model.freeze), n_frozen / 1e6, n_params / 1e6)


def _checkpointer(cfg: TrainConfig, info: DistInfo, group, faults: Faults, output_dir: str,
                  n_params: int, n_frozen: int) -> Checkpointer:
    """The run's checkpointer; rank 0 warns when the disk cannot hold the checkpoints."""
    adapters = uses_adapters(cfg.peft)  # (then the frozen base is referenced, not saved)
    per_checkpoint = checkpoint_bytes(n_params - n_frozen if adapters else n_params,
                                      n_params - n_frozen,
                                      torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8)
    checkpointer = Checkpointer(checkpoint_root(cfg.checkpoint.dir, output_dir),
                                cfg.checkpoint.keep_last, info.rank, faults, per_checkpoint,
                                group, trainable_only=adapters,
                                background=_background_saver(cfg, info, group),
                                export_dtype=cfg.checkpoint.export_dtype,
                                export_shard=cfg.checkpoint.export_max_shard_size)
    if info.is_main:
        warn_if_short_of_space(checkpointer.root, per_checkpoint, cfg.checkpoint,
                               cfg.trainer.max_steps)
    return checkpointer


def _background_saver(cfg: TrainConfig, info: DistInfo, group):
    """``checkpoint.async_mode``: the background saver, with its own gloo group of the model's
    ranks (made once; a background collective must not share the training's group), which
    keeps ``checkpoint.save_timeout_minutes`` for the whole write, across training steps."""
    c = cfg.checkpoint
    if c.async_mode == AsyncMode.none:
        return None
    from automodel.checkpoint.background import BackgroundSaver

    saver_group = None
    if dist.is_initialized():
        if group is not None and group is not dist.group.WORLD:
            raise ValueError("checkpoint.async_mode: a job holding several models saves "
                             "synchronously (its background group would need every model's "
                             "ranks); set checkpoint.async_mode=none")
        saver_group = new_group_with_own_timeout(
            datetime.timedelta(minutes=c.save_timeout_minutes), "checkpoint")
    return BackgroundSaver(c.async_mode, saver_group, info.rank, c.pinned_memory)


def initial_model(cfg: TrainConfig, info: DistInfo, group=None):
    """(model, materialize). With a process group every rank builds the model on the meta
    device and ``parallelize`` materializes only its shards: read as slices from a pretrained
    safetensors checkpoint by every rank, or else filled from the first rank's full copy (from
    config with the seed, or another checkpoint format). A lone process builds the real model
    directly."""
    seed = cfg.trainer.seed
    if not dist.is_initialized():
        model = build_model(cfg.model, seed)
        _adapt(model, cfg)
        init_adapters([model], cfg.peft, seed)
        return model.to(info.device), None
    model = build_meta_model(cfg.model)
    adapted = _adapt(model, cfg)
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
        if adapted:
            init_adapters(parts, cfg.peft, seed)

    # (parallelism.init_fsdp_with_meta_device: megatron-fsdp fills one module at a time)
    fill.source = ModuleSource(files, lambda: full_initial_state(cfg.model, seed), seed, group)
    return model, fill


def _adapt(model: torch.nn.Module, cfg: TrainConfig) -> list[str]:
    """``peft``'s adapters on ``model`` (checked before launch: refusals here are bugs)."""
    return add_adapters(model, cfg.peft, str(cfg.trainer.loss), tuple(cfg.model.freeze))


def _restarted_from(cfg: TrainConfig, root: str) -> str | None:
    """A requeued job, or ranks started again inside the job: the newest complete checkpoint
    of the run's own ``checkpoint.dir``, whatever ``checkpoint.resume`` names (that is the
    first start's); None when the run has saved none yet (or this is its first start)."""
    if cfg.launch.restarts > 0:
        why = f"SLURM requeued this job (restart {cfg.launch.restarts})"
    elif in_job_restart() > 0:
        why = (f"the job's ranks were started again (in-job restart {in_job_restart()} of "
               f"distributed.max_restarts={cfg.distributed.max_restarts})")
    else:
        return None
    found = complete_checkpoints(root)
    if not found:
        log.info("%s: no checkpoint of this run in %s yet; starting as the first start did",
                 why, root)
        return None
    log.info("%s: resuming from the run's newest checkpoint, %s", why, found[-1])
    return found[-1]


def restore(cfg: TrainConfig, parts: Components) -> int:
    """Load the checkpoint ``checkpoint.resume`` names; returns the step to start from."""
    checkpointer = parts.checkpointer
    path = _restarted_from(cfg, checkpointer.root) or cfg.checkpoint.resume
    if path == "auto":
        found = complete_checkpoints(checkpointer.root)
        path = found[-1] if found else None
        if path is None:
            log.warning("checkpoint.resume=auto: looked in %s and found no complete "
                        "checkpoint; starting at step 0", checkpointer.root)
        else:
            log.warning("checkpoint.resume=auto: looked in %s and found the checkpoint of "
                        "step %d (%s); resuming from it", checkpointer.root, step_of(path),
                        path)
    exclude = tuple(cfg.checkpoint.exclude_from_loading)
    if path is None and cfg.checkpoint.initial_load_path is not None:
        path = cfg.checkpoint.initial_load_path  # (a fresh run: the weights alone)
        checkpointer.load(path, parts.parallel.parts, parts.optimizer, parts.scheduler,
                          exclude=LOAD_PARTS)
        log.info("checkpoint.initial_load_path: the weights of %s; a fresh optimizer, LR "
                 "schedule and step counter", path)
        return 0
    if path is None:
        return 0
    step = checkpointer.load(path, parts.parallel.parts, parts.optimizer, parts.scheduler,
                             exclude=exclude)
    left = f" (left out: {', '.join(exclude)})" if exclude else ""
    log.info("resumed from %s after step %d%s", path, step, left)
    return step
