"""What the runner reports after each step: the progress bar every step; every
``trainer.log_every`` steps (and the first, the last and any skipped step) one record to
``metrics.jsonl``, W&B (rank 0) and the log line."""

from __future__ import annotations

import logging
import resource
import time

import torch
import torch.distributed as dist

from automodel.config.resolve import TrainConfig
from automodel.distributed.init import DistInfo
from automodel.tracking.metrics import MetricsWriter
from automodel.tracking.progress import Progress

log = logging.getLogger("automodel")


def peak_memory_bytes(info: DistInfo) -> int:
    """The largest peak over all ranks: CUDA allocations, else the process's resident set."""
    if info.device.type == "cuda":
        value = torch.cuda.max_memory_allocated(info.device)
    else:  # Linux reports the peak resident set in KiB
        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if dist.is_initialized():
        t = torch.tensor([value], dtype=torch.float64, device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        value = int(t.item())
    return int(value)


class StepLog:
    def __init__(self, cfg: TrainConfig, info: DistInfo, output_dir: str, start_step: int,
                 last_step: int, extra=None):
        """``extra()``: more fields for a record (called on every rank: may be collective)."""
        self.cfg, self.info, self.extra = cfg, info, extra
        self.records: list[dict] = []
        self.metrics = MetricsWriter(output_dir, info.is_main)
        self.tracker = None
        if info.is_main and cfg.logger.wandb is not None:
            from automodel.tracking.wandb_logger import WandbTracker

            self.tracker = WandbTracker(cfg.logger.wandb, output_dir, cfg.resolved,
                                        cfg.choices, cfg.overrides, cfg.sweep_dir)
        self.progress = Progress(last_step, enabled=info.is_main, initial=start_step)
        self.window_tokens, self.window_start = 0, time.perf_counter()
        self.peak = None

    def logging_redirect(self):
        return self.progress.logging_redirect()

    def step(self, number: int, loss: float, grad_norm: float, lr: float, tokens: int,
             seconds: float, skipped: bool) -> None:
        t = self.cfg.trainer
        self.window_tokens += tokens
        if number % t.log_every == 0 or number in (1, t.max_steps) or skipped:
            elapsed = time.perf_counter() - self.window_start
            self.peak = peak_memory_bytes(self.info)
            record = {"step": number, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                      "tokens_per_second": self.window_tokens / max(elapsed, 1e-9),
                      "peak_memory_bytes": self.peak}
            if skipped:
                record["skipped"] = True
            if self.extra is not None:
                record.update(self.extra())
            self.records.append(record)
            self.metrics.write(record)
            if self.tracker is not None:
                self.tracker.log(record)
            log.info("step %d/%d  loss %.4f  grad_norm %.3f  lr %.2e  %.0f tok/s  peak %.0f MiB",
                     number, t.max_steps, loss, grad_norm, lr, record["tokens_per_second"],
                     self.peak / 2**20)
            self.window_tokens, self.window_start = 0, time.perf_counter()
        self.progress.update(loss, tokens / max(seconds, 1e-9), self.peak)

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
        if self.tracker is not None:
            self.tracker.finish()
