"""What the runner reports after each step: the progress bar every step; every
``trainer.log_every`` steps (and the first, the last and any skipped step) one record to
``metrics.jsonl``, W&B (rank 0) and the log line. The values come from the step's one read
(``recipes/step_values.py``): nothing here reads the device."""

from __future__ import annotations

import logging
import resource
import time

import torch

from automodel.config.resolve import TrainConfig
from automodel.distributed.init import DistInfo
from automodel.tracking.memory import TensorPeak
from automodel.tracking.metrics import MetricsWriter
from automodel.tracking.progress import Progress

log = logging.getLogger("automodel")


def local_peak_memory_bytes(info: DistInfo, tensor_peak: TensorPeak | None = None) -> int:
    """This rank's peak so far: CUDA allocations, else the process's resident set (host
    counters, no device read; ``read_step`` takes the largest over the model's ranks).
    ``tensor_peak``: the step's count of tensor bytes, which restarts the CUDA allocator's
    peak at each read and keeps the largest so far."""
    if info.device.type == "cuda":
        so_far = tensor_peak.so_far if tensor_peak is not None else 0
        return max(int(torch.cuda.max_memory_allocated(info.device)), so_far)
    try:  # the process's own peak (ru_maxrss would carry the launcher's over the exec)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: in KiB


class StepLog:
    def __init__(self, cfg: TrainConfig, info: DistInfo, output_dir: str, start_step: int,
                 last_step: int, wandb_run_id: str | None = None):
        """``wandb_run_id``: the W&B run of the checkpoint resumed from, which continues."""
        self.cfg, self.info = cfg, info
        self.records: list[dict] = []
        self.metrics = MetricsWriter(output_dir, info.is_main)
        self.tracker = None
        if info.is_main and cfg.logger.wandb is not None:
            from automodel.tracking.wandb_logger import WandbTracker

            self.tracker = WandbTracker(cfg.logger.wandb, output_dir, cfg.resolved,
                                        cfg.choices, cfg.overrides, cfg.sweep_dir,
                                        resumed_id=wandb_run_id, experiment=cfg.experiment)
        self.progress = Progress(last_step, enabled=info.is_main, initial=start_step)
        self.window_tokens, self.window_start = 0, time.perf_counter()
        self.peak = None
        self.tensor_peaks: list | None = None  # by rank, since the last record

    def logging_redirect(self):
        return self.progress.logging_redirect()

    def step(self, number: int, values, lr: float, seconds: float, epoch: float,
             eval_loss: float | None = None) -> None:
        """``values``: the step's ``StepValues`` (not finite: the step was skipped). The peak
        memory is the one read with them: up to the step's gradient clipping, so an optimizer
        step's allocations show from the next step on (the peak of live tensor bytes of step
        n >= 2 covers the optimizer step of step n - 1, then step n up to its clipping: one
        whole step; a record takes each rank's largest since the last record). ``epoch``:
        passes over the training rows so far (1.5: half-way through the second);
        ``eval_loss``: the evaluation run after this step, if one ran (its step always gets a
        record)."""
        t = self.cfg.trainer
        loss, grad_norm, tokens = values.loss, values.grad_norm, values.tokens
        skipped = not values.finite
        self.window_tokens += tokens
        self.peak = values.peak_memory_bytes
        self._tensor_peaks(values.peak_tensor_bytes_by_rank)
        if (number % t.log_every == 0 or number in (1, t.max_steps) or skipped
                or eval_loss is not None):
            elapsed = time.perf_counter() - self.window_start
            record = {"step": number, "epoch": round(epoch, 6), "loss": loss,
                      "grad_norm": grad_norm, "lr": lr,
                      "tokens_per_second": self.window_tokens / max(elapsed, 1e-9),
                      "peak_memory_bytes": self.peak, **self._tensor_record()}
            if eval_loss is not None:
                record["eval_loss"] = eval_loss
            if skipped:
                record["skipped"] = True
            record.update(values.extra)
            self.records.append(record)
            self.metrics.write(record)
            if self.tracker is not None:
                self.tracker.log(record)
            log.info("step %d/%d  epoch %.2f  loss %.4f  grad_norm %.3f  lr %.2e  %.0f tok/s  "
                     "peak %.0f MiB%s", number, t.max_steps, epoch, loss, grad_norm, lr,
                     record["tokens_per_second"], self.peak / 2**20,
                     "" if eval_loss is None else f"  eval_loss {eval_loss:.4f}")
            self.window_tokens, self.window_start = 0, time.perf_counter()
        self.progress.update(loss, tokens / max(seconds, 1e-9), self.peak, eval_loss)

    def _tensor_peaks(self, by_rank: list | None) -> None:
        if by_rank is not None:
            self.tensor_peaks = [max(a, b) for a, b in zip(self.tensor_peaks, by_rank)] \
                if self.tensor_peaks else list(by_rank)

    def _tensor_record(self) -> dict:
        """``peak_tensor_bytes`` (the largest rank's) and ``peak_tensor_bytes_by_rank`` (by
        the model's rank) since the last record; then the next record's window starts."""
        by_rank, self.tensor_peaks = self.tensor_peaks, None
        return {"peak_tensor_bytes": max(by_rank) if by_rank else None,
                "peak_tensor_bytes_by_rank": by_rank}

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
        if self.tracker is not None:
            self.tracker.finish()
