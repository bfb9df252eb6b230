"""Save and load training state with torch.distributed.checkpoint (each rank writes its shards).

A checkpoint is the directory ``<dir>/step_<NNNNNNNN>``: model and optimizer state through the
distributed state-dict helpers (keys are the model's own parameter names, whatever the
layout: DDP, FSDP2 or TP shards, pipeline stages), the optimizer state flattened to those
names too, so a checkpoint written under one layout loads under another; plus
``trainer.json`` (step, LR schedule), ``model_config.json`` (for export) and
``rng_rank<R>.pt``. The data position is the step (batches are a function of the step).

A save goes to ``.tmp-step_N`` and the model's rank 0 renames it once every rank of the model
(its process group: the job may hold other models on other ranks) has written its shards
and ``trainer.json`` is in place (and, with ``checkpoint.export_hf``, the Hugging Face export:
its writers, one rank per host, ``export_job.py``), so a checkpoint is complete or absent.
Leftovers of an interrupted save are never loaded and are removed at the next save.

A run with adapters saves the weights its optimizer trains and nothing else: no frozen weight
(also none under a second name: a tied head), no buffer; the base is referenced.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from automodel.checkpoint.export_job import JobExport
from automodel.checkpoint.paths import checkpoint_path, complete_checkpoints
from automodel.checkpoint.verify import CheckpointError, check_files, check_keys
from automodel.compat import flatten_state_dict
from automodel.errors import CheckpointWriteError, describe, no_space, os_error, size

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# a run with adapters (peft): the trainable weights only, the frozen base referenced
# (``automodel/peft/base_ref.py``); loading leaves the frozen weights as built.
# (torch's ``ignore_frozen_params`` keeps a tied alias of a frozen weight, such as
# ``lm_head.weight``, and buffers: ``_part_states`` drops them.)
TRAINABLE_ONLY = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True,
                                  strict=False)
log = logging.getLogger(__name__)


def _barrier(group):
    if dist.is_initialized():
        dist.barrier(group=group)


def _part_states(parts, optimizers, options=OPTIONS) -> list[tuple[dict, dict]]:
    states = [get_state_dict(part, opt, options=options)
              for part, opt in zip(parts, optimizers.optimizers)]
    if options is TRAINABLE_ONLY:
        states = [(_trained(model, optim), optim) for model, optim in states]
    return states


def _trained(model: dict, optim: dict) -> dict:
    """The weights the optimizer trains, of a model state: no frozen weight under a second
    name (a tied embedding), no buffer. (The flattened optimizer state names every trained
    weight in ``param_groups.<name>.lr``, also before its first step.)"""
    return {k: v for k, v in model.items() if f"param_groups.{k}.lr" in optim}


def _merged(states) -> dict:
    model, optim = {}, {}
    for m, o in states:
        model.update(m)
        optim.update(o)
    return {"model": model, "optim": optim}


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when there is no process group: so do we."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _state_bytes(state: dict) -> int:
    """Bytes of this rank's tensors in ``state`` (its shards of DTensors)."""
    flat, _ = flatten_state_dict(state)
    total = 0
    for value in flat.values():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def _gather(obj, group) -> list:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return [obj]


def _ranks(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


@dataclass
class _SaveJob:
    step: int
    tmp: str  # where it is written before the rename
    meta: dict  # trainer.json
    model_config: dict | None
    export_hf: bool
    tokenizer: str | None


class Checkpointer:
    """``rank``: this rank within ``group``, the model's ranks (default: the world), over
    which every collective of a save or a load runs; its rank 0 writes the shared files."""

    def __init__(self, root: str, keep_last: int | None, rank: int, faults=None,
                 size_estimate: int = 0, group=None, trainable_only: bool = False,
                 background=None, export_dtype: str | None = None,
                 export_shard: str = "5GB"):
        self.background = background  # a BackgroundSaver (checkpoint.async_mode) or None
        self.export = JobExport(export_dtype, export_shard)  # the Hugging Face export
        self.root = root
        self.options = TRAINABLE_ONLY if trainable_only else OPTIONS
        self.keep_last = keep_last
        self.rank = rank
        self.group = group
        self.faults = faults
        self.size_estimate = size_estimate  # bytes of one checkpoint (for messages)
        self.loaded_meta: dict = {}  # trainer.json of the checkpoint loaded (W&B run id)

    def path(self, step: int) -> str:
        return checkpoint_path(self.root, step)

    def save(self, step: int, parts, optimizers, scheduler, model_config=None,
             extra: dict | None = None, export_hf: bool = False, blocking: bool = True,
             model_only: bool = False) -> str:
        """Write the checkpoint of ``step``; a file-system failure (a full disk) raises
        ``CheckpointWriteError`` naming the path, the space needed and free, and the last
        complete checkpoint, after removing the unfinished one. With a background saver and
        ``blocking=False``, return once the state is staged (``checkpoint/background.py``);
        any save first waits for the one in flight. ``model_only``: no optimizer state
        (``trainer.json`` says so; a load must exclude the optimizer)."""
        tmp = os.path.join(self.root, f".tmp-step_{step:08d}")
        if self.background is not None:
            self.background.wait(f"the save of step {step}")
            self.background.raise_if_failed()
        if export_hf:
            self.export.place(self.group, self.rank)
        meta = {**self._meta(step, scheduler, extra), **({"model_only": True} if model_only
                                                        else {})}
        job = _SaveJob(step, tmp, meta, model_config, export_hf,
                       (extra or {}).get("tokenizer_path"))
        try:
            state = self._prepare(tmp, parts, optimizers, model_only)
            if self.background is not None and not blocking:
                return self._start_background(job, state)
            return self._save(job, state)
        except (Exception, CheckpointException) as err:
            free = shutil.disk_usage(self.root).free if os.path.isdir(self.root) else None
            # a full disk does not always say so (torch's writer may report only "unexpected
            # pos"): a save that fails with the file system (nearly) full is taken as one
            full = no_space(err) or (free is not None
                                     and free < max(self.size_estimate, 1 << 20))
            if os_error(err) is None and not full:
                raise
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(self._write_failure(step, tmp, err, full, free)) \
                from err

    def _write_failure(self, step: int, tmp: str, err: BaseException, full: bool,
                       free: int | None) -> str:
        cause = describe(err)
        if full:
            cause = (f"no space left on the device (ENOSPC: {cause})" if no_space(err) else
                     f"no space left on the device (ENOSPC: the file system is full; the "
                     f"writer said {cause})")
        found = complete_checkpoints(self.root)
        need = f"it needs about {size(self.size_estimate)}, " if self.size_estimate else ""
        space = f"{need}{size(free)} free there; " if free is not None else ""
        fix = ("free space, or point checkpoint.dir elsewhere (checkpoint.keep_last bounds how "
               "many are kept)" if full else "fix the file system")
        last = (f"the last complete checkpoint is {found[-1]}: {fix}, then run again with "
                "checkpoint.resume=auto" if found else f"no complete checkpoint exists: {fix}")
        return (f"cannot write the checkpoint of step {step} to {self.path(step)}: {cause}. "
                f"{space}the unfinished {tmp} was removed; {last}")

    def _prepare(self, tmp: str, parts, optimizers, model_only: bool) -> dict:
        """Rank 0 clears what an unfinished save left and makes ``tmp``; every rank's state
        (references to its shards), and this rank's RNG state written into ``tmp``."""
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):  # an earlier save that never finished
                if name.startswith((".tmp-", ".old-")):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            os.makedirs(tmp)
        _barrier(self.group)
        state = _merged(_part_states(parts, optimizers, self.options))
        if model_only:
            del state["optim"]
        self.size_estimate = max(self.size_estimate, _state_bytes(state) * _ranks(self.group))
        torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        return state  # (the size: for a failure message)

    def _save(self, job: "_SaveJob", state: dict) -> str:
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=job.tmp, no_dist=not dist.is_initialized(),
                     process_group=self.group)
        if self.faults is not None:
            self.faults.in_save(job.step)
        _barrier(self.group)
        self._complete(job, self.group)
        _barrier(self.group)
        return self.path(job.step)

    def _start_background(self, job: "_SaveJob", state: dict) -> str:
        def finish():
            self._complete(job, self.background.group)

        with _quiet_single_process():
            self.background.start(job.step, self.path(job.step), state, job.tmp, finish,
                                  self.faults)
        return self.path(job.step)

    def _meta(self, step: int, scheduler, extra) -> dict:
        """``trainer.json``, taken when the save starts (the scheduler moves on)."""
        return copy.deepcopy({"step": step, "scheduler": scheduler.state_dict(),
                              "world_size": _ranks(self.group), **(extra or {})})

    def _complete(self, job: "_SaveJob", group) -> None:
        """Every rank of ``group``, once every rank's shards are written: rank 0 writes the
        shared files; the export's writers (one rank per host) write their files of it;
        rank 0 finishes the export and publishes the checkpoint."""
        if self.rank == 0:
            self._write_records(job)
        export = (self.export.write_share(job.tmp, job.model_config, job.meta, job.step, group,
                                          self.rank) if job.export_hf else None)
        if self.rank == 0:
            if export is not None:
                export.finish(os.path.join(job.tmp, "hf.tmp"), os.path.join(job.tmp, "hf"),
                              job.tokenizer)
            self._publish(job)

    def _write_records(self, job: "_SaveJob") -> None:
        if job.model_config is not None:
            with open(os.path.join(job.tmp, "model_config.json"), "w") as f:
                json.dump(job.model_config, f, indent=1, sort_keys=True)
        with open(os.path.join(job.tmp, "trainer.json"), "w") as f:
            json.dump(job.meta, f, indent=1)

    def _publish(self, job: "_SaveJob") -> None:
        """Rank 0, once every rank's shards and the export are written: the atomic rename
        that makes the checkpoint visible, and ``keep_last``."""
        final, tmp = self.path(job.step), job.tmp
        old = os.path.join(self.root, f".old-step_{job.step:08d}")
        if os.path.isdir(final):  # the same step saved by an earlier run: keep it until
            os.replace(final, old)  # the new one is in place
        os.replace(tmp, final)  # the checkpoint appears whole
        shutil.rmtree(old, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        if self.keep_last:
            for old in complete_checkpoints(self.root)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: str, parts, optimizers, scheduler, exclude=()) -> int:
        """Restore what was saved at ``path`` (any layout), less ``exclude`` (of
        ``optimizer``, ``scheduler``, ``step``, ``rng``); returns the step it was saved after
        (0 when ``step`` is excluded). Raises CheckpointError, naming the path and keys,
        before changing anything."""
        meta = check_files(path)
        with open(os.path.join(path, "trainer.json")) as f:
            trainer = json.load(f)
        if trainer.get("model_only") and "optimizer" not in exclude:
            raise CheckpointError(
                f"checkpoint {path} holds the model's weights only (saved with "
                "checkpoint.last_save_model_only=true): start from its weights with "
                "checkpoint.initial_load_path, or add optimizer to "
                "checkpoint.exclude_from_loading")
        states = _part_states(parts, optimizers, self.options)
        state = _merged(states)
        if "optimizer" in exclude:
            del state["optim"]
        self._check(path, meta, state)
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized(),
                     process_group=self.group)
        for (m, o), part, opt in zip(states, parts, optimizers.optimizers):
            weights = {k: state["model"][k] for k in m}
            if "optim" not in state:  # (the optimizer stays as built: fresh)
                set_model_state_dict(part, weights, options=self.options)
                continue
            set_state_dict(part, opt, model_state_dict=weights,
                           optim_state_dict={k: state["optim"][k] for k in o},
                           options=self.options)
        self.loaded_meta = trainer
        if "scheduler" not in exclude:
            scheduler.load_state_dict(trainer["scheduler"])
        rng = os.path.join(path, f"rng_rank{self.rank}.pt")
        if "rng" not in exclude and os.path.isfile(rng):  # (a rank the saving job did not
            _set_rng_state(torch.load(rng))  # have keeps its own)
        return 0 if "step" in exclude else int(trainer["step"])

    def _check(self, path: str, meta, state: dict) -> None:
        """The keys and shapes this rank loads against the checkpoint's, every rank raising
        the same error (none is left waiting)."""
        flat, _ = flatten_state_dict(state)
        model_keys = set().union(*_gather({k for k in flat if k.startswith("model.")},
                                          self.group))
        if self.options is TRAINABLE_ONLY:  # (an adapter checkpoint of an earlier version may
            model_keys |= _untrained(meta)  # hold a tied alias or a buffer: never loaded)
        try:
            check_keys(path, meta, flat, model_keys)
            problem = None
        except CheckpointError as err:
            problem = str(err)
        problems = [p for p in _gather(problem, self.group) if p]
        if problems:
            raise CheckpointError(problems[0])


def _untrained(meta) -> set[str]:
    """The model keys of a checkpoint that its optimizer did not train (none in a checkpoint
    saved without its optimizer)."""
    saved = meta.state_dict_metadata
    if not any(k.startswith("optim.") for k in saved):
        return set()
    return {k for k in saved if k.startswith("model.")
            and f"optim.param_groups.{k[len('model.'):]}.lr" not in saved}


def checkpoint_bytes(params: int, trainable: int, param_bytes: int) -> int:
    """About the size of one checkpoint: the parameters and AdamW's two states per trainable
    parameter, in the parameters' dtype."""
    return (params + 2 * trainable) * param_bytes


def warn_if_short_of_space(root: str, per_checkpoint: int, ckpt, max_steps: int) -> None:
    """At start-up: warn when the file system of ``root`` cannot hold the checkpoints this run
    keeps (``checkpoint.keep_last`` of them, plus the one being written, plus HF exports)."""
    saves = max_steps // ckpt.every_steps if ckpt.every_steps else 0
    if ckpt.export_hf != "never" and not saves:
        saves = 1  # the final one
    if not saves:
        return
    kept = min(saves, ckpt.keep_last) if ckpt.keep_last else saves
    each = per_checkpoint * (1.5 if ckpt.export_hf != "never" else 1.0)  # (an export: the
    # weights again)
    need = int(each * min(kept + 1, saves))
    where = root
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    if free < need:
        log.warning("checkpoint.dir: %s has %s free, but this run's checkpoints need about %s "
                    "(%d kept of about %s each, one more while a new one is written): the run "
                    "may stop at a save; free space, point checkpoint.dir elsewhere or lower "
                    "checkpoint.keep_last", where, size(free), size(need), kept, size(each))


__all__ = ["Checkpointer", "CheckpointError"]
