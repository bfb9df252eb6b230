"""The end of a run: the last checkpoint, closing what the loop opened, and the stop.

A run that finished saves its last step when checkpoints (or the HF export) are on and that
step is not saved yet; a run stopped by a signal saves where it stopped, then raises
``TrainingStopped`` (under SLURM after handing the job to submitit for a requeue).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from automodel.distributed.init import set_collective_timeout
from automodel.errors import TrainingStopped
from automodel.recipes.loop import Run

log = logging.getLogger("automodel")


def save_last(run: Run) -> None:
    """Save the step the run ended at, unless it is saved already: when a signal stopped the
    run, or when the run reached ``trainer.max_steps`` with checkpoints or the export on."""
    cfg = run.cfg
    final = (run.number == cfg.trainer.max_steps
             and (cfg.checkpoint.every_steps or cfg.checkpoint.export_hf != "never"))
    if run.saved_step != run.number and (run.stopped_by is not None or final):
        run.save(run.number)


def close(run: Run, failed: bool) -> None:
    """Close the prefetcher, the signal handlers and the step log. A failing rank leaves at
    once: no collective here (its peers may be inside another one, and it would wait out the
    timeout); the launcher stops them."""
    run.batches.close()
    background = run.parts.checkpointer.background
    if background is not None and not failed:  # (the save in flight completes first)
        background.close()
    run.stop.restore()
    if not failed:
        set_collective_timeout(run.info.startup_timeout, run.group)  # rank 0 alone finishes W&B
    run.steplog.close()


def raise_if_stopped(run: Run) -> None:
    """A signal stopped the run: raise ``TrainingStopped`` (naming the checkpoint); under SLURM
    rank 0 first hands the job to submitit for a requeue, and no rank ends before it is done."""
    if run.stopped_by is None:
        return
    stopped = TrainingStopped(run.stopped_by, run.number, run.parts.checkpointer.path(run.number))
    log.warning("%s", stopped)
    if run.cfg.launch.kind == "slurm":
        if run.stop.hand_over_to_submitit():  # rank 0: submitit requeues the job
            log.warning("SLURM job requeued through submitit")
        if run.group is not None:  # no rank ends before the requeue is done
            dist.barrier(group=run.group)
    raise stopped
