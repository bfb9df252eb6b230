"""The step loop: one optimizer step after another, from the step the run resumed after to
``trainer.stop_at_step`` (else ``trainer.max_steps``), with its evaluation, record, periodic
checkpoint and stop-signal check after each step.

``Run`` holds what lives for the loop (the step log, the stop signal, the profiler, the batch
prefetcher) and where the loop is; ``recipes/finish.py`` closes it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from dataclasses import dataclass

from torch.profiler import record_function

from automodel.config.resolve import TrainConfig
from automodel.data.prefetch import Prefetcher
from automodel.distributed.init import DistInfo, set_collective_timeout
from automodel.distributed.setup import DistributedSetup
from automodel.models.weight_files import model_source
from automodel.recipes.components import Components
from automodel.recipes.pipeline_step import step_loader_options
from automodel.recipes.step import train_step
from automodel.recipes.step_log import StepLog
from automodel.recipes.step_values import StepValues, read_step
from automodel.runtime.failure import set_phase
from automodel.runtime.signals import StopSignal
from automodel.tracking.memory import TensorPeak, tensor_peak_for
from automodel.tracking.plan_check import PlanCheck, plan_check_for
from automodel.tracking.profile import StepProfiler

log = logging.getLogger("automodel")


@dataclass
class Run:
    """A run's loop: what it built, what lives for the loop, and where it is."""

    cfg: TrainConfig
    setup: DistributedSetup
    parts: Components
    steplog: StepLog
    stop: StopSignal
    profiler: StepProfiler
    batches: Prefetcher
    start_step: int
    last_step: int
    saved_step: int  # the step of the last checkpoint (saved or resumed from)
    number: int  # the number of the last step run (1-based; start_step before any)
    stopped_by: int | None = None  # the signal that stopped the run early
    tensor_peak: TensorPeak | None = None  # peak_tensor_bytes (trainer.track_tensor_memory)
    plan_check: PlanCheck | None = None  # the plan beside the run (trainer.plan_check_steps)

    @property
    def info(self) -> DistInfo:
        return self.setup.dist  # ranks within the model's group

    @property
    def group(self):
        return self.setup.process_group  # every collective of the recipe's own runs on it

    def save(self, step_number: int, blocking: bool = True) -> None:
        """Save a checkpoint after step ``step_number``; ``blocking=False``: under
        ``checkpoint.async_mode``, return once the state is staged."""
        cfg, parts, info = self.cfg, self.parts, self.info
        extra = {"tokenizer_path": getattr(cfg.data, "tokenizer_path", None),
                 "model_source": model_source(cfg.model)}  # (the export's dtype and files)
        if parts.adapters:  # (what the export needs to merge them, or write them for peft)
            extra["peft"] = parts.adapters
        if self.steplog.tracker is not None:  # (a resumed run continues this W&B run)
            extra["wandb_run_id"] = self.steplog.tracker.run.id
        start = time.monotonic()
        with longer_timeout(info, self.group, datetime.timedelta(  # (rank 0 exports and
                minutes=cfg.checkpoint.save_timeout_minutes)):  # prunes alone)
            set_phase(f"checkpoint save (step {step_number}, "
                      f"{parts.checkpointer.path(step_number)})")
            last = step_number == cfg.trainer.max_steps
            export = cfg.checkpoint.export_hf == "every" or (
                cfg.checkpoint.export_hf == "final" and last)
            path = parts.checkpointer.save(
                step_number, parts.parallel.parts, parts.optimizer, parts.scheduler,
                parts.model_config, extra, export_hf=export, blocking=blocking,
                model_only=last and cfg.checkpoint.last_save_model_only)
        self.saved_step = step_number
        if parts.checkpointer.background is not None and not blocking:
            log.info("checkpoint staged: %s (training blocked %.2f s; written in the "
                     "background)", path, time.monotonic() - start)
        else:
            log.info("checkpoint saved: %s (%.2f s)", path, time.monotonic() - start)


def start_run(cfg: TrainConfig, setup: DistributedSetup, parts: Components, output_dir: str,
              start_step: int) -> Run:
    """Open the step log, install the stop signal handlers, and start the profiler and the
    prefetcher of the run's batches."""
    t, info = cfg.trainer, setup.dist
    last_step = t.stop_at_step or t.max_steps
    steplog = StepLog(cfg, info, output_dir, start_step, last_step,
                      wandb_run_id=parts.checkpointer.loaded_meta.get("wandb_run_id"))
    stop = StopSignal().install()
    profiler = StepProfiler(t.profile_steps, output_dir, info.rank, info.is_main,
                            info.device.type)
    plan, options = parts.plan, step_loader_options(parts.pipeline, t.local_batch_size)
    batches = Prefetcher(
        lambda step: plan.micro_batches(step, setup.dp_rank, setup.dp_size, **options),
        t.prefetch_steps, last_step, pin_memory=setup.device.type == "cuda")
    return Run(cfg, setup, parts, steplog, stop, profiler, batches, start_step, last_step,
               saved_step=start_step, number=start_step,
               tensor_peak=tensor_peak_for(info.device, t.track_tensor_memory,
                                           parts.parallel.parts, parts.optimizer.optimizers),
               plan_check=plan_check_for(cfg, setup, output_dir, start_step,
                                         setup.process_group))


def run_steps(run: Run) -> None:
    """Run the steps; returns after the last one, or early when a stop signal reached any rank
    (``run.stopped_by``)."""
    cfg, parts = run.cfg, run.parts
    every = cfg.checkpoint.every_steps
    for step in range(run.start_step, run.last_step):
        number = run.number = step + 1
        values, lr, seconds = one_step(run, step)
        eval_loss = None
        if parts.evaluator is not None and values.finite and parts.evaluator.due(number):
            set_phase(f"evaluation after step {number}")
            eval_loss = parts.evaluator(parts.parallel.parts)
            set_phase(f"step {number}")
        run.steplog.step(number, values, lr, seconds, parts.plan.epochs(number), eval_loss)
        if run.plan_check is not None:
            run.plan_check.after(number, seconds, values)
        if step == run.start_step:  # start-up (compile, loads, W&B start) is over
            set_collective_timeout(run.info.timeout, run.group)
        if every and number % every == 0:
            run.save(number, blocking=number == cfg.trainer.max_steps)
        run.stopped_by = values.stop_signal
        if run.stopped_by is not None and number < run.last_step:
            break
        run.stopped_by = None  # (a signal during the last step: the run is done anyway)


def one_step(run: Run, step: int) -> tuple[StepValues, float, float]:
    """Step ``step + 1``: forward and backward, the step's one read, then the optimizer step
    (which a non-finite step never runs); returns (its values, its learning rate, its
    seconds)."""
    parts, number = run.parts, step + 1
    set_phase(f"step {number}")
    if parts.checkpointer.background is not None:  # a background save that failed ends
        parts.checkpointer.background.raise_if_failed()  # the run here, naming its cause
    parts.faults.before_step(number)
    run.profiler.begin(number)
    started = time.perf_counter()
    lr = parts.scheduler.get_last_lr()[0]
    micro = run.batches.get(step)
    with contextlib.ExitStack() as windows:
        if run.plan_check is not None:
            windows.enter_context(run.plan_check.window(number))
        if run.tensor_peak is not None:
            windows.enter_context(run.tensor_peak.window(micro))
        values = _step_and_update(run, number, micro)
    parts.scheduler.step()
    run.profiler.end(number)
    return values, lr, time.perf_counter() - started


def _step_and_update(run: Run, number: int, micro) -> StepValues:
    """Forward, backward and clipping, the step's one read, the optimizer step (counted in
    ``run.tensor_peak``'s window when it counts on the CPU)."""
    cfg, parts = run.cfg, run.parts
    hooks = parts.faults.poison_logits(number, parts.parallel.parts)
    if parts.pipeline is not None:
        stats = parts.pipeline(micro, cfg.optim.max_grad_norm)
    else:
        stats = train_step(parts.model, run.setup, micro, cfg.optim.max_grad_norm,
                           parts.router_loss, parts.parallel.head_loss)
    for h in hooks:
        h.remove()
    # The step's one device-to-host read (loss, norm, tokens, peak memory, the stop signal of
    # any rank, each rank's peak of live tensor bytes): the same values on every rank, so
    # every rank takes the same branches. Before the optimizer step, which a non-finite step
    # never runs.
    values = read_step(stats, run.info, run.stop.received, run.group, run.tensor_peak)
    if values.finite:
        with record_function("automodel::optimizer"):
            parts.optimizer.step()
    else:
        _nonfinite(number, values.loss, values.grad_norm, cfg.trainer.on_nonfinite,
                   run.saved_step)
    parts.optimizer.zero_grad(set_to_none=True)
    return values


@contextlib.contextmanager
def longer_timeout(info: DistInfo, group, timeout: datetime.timedelta):
    """Collectives wait up to ``timeout`` inside (a save: ranks write at their own pace, and
    rank 0 completes it alone), then the training timeout again."""
    set_collective_timeout(max(timeout, info.timeout), group)
    try:
        yield
    finally:
        set_collective_timeout(info.timeout, group)


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
