"""Save and load training state with torch.distributed.checkpoint (each rank writes its shards).

A checkpoint is the directory ``<dir>/step_<NNNNNNNN>``: model and optimizer state through the
distributed state-dict helpers (keys are the model's own parameter names, whatever the
layout: DDP, FSDP2 or TP shards, pipeline stages), the optimizer state flattened to those
names too, so a checkpoint written under one layout loads under another; plus
``trainer.json`` (step, LR schedule), ``model_config.json`` (for export) and
``rng_rank<R>.pt``. The data position is the step (batches are a function of the step).

A save goes to ``.tmp-step_N`` and rank 0 renames it once every rank has written its shards
and ``trainer.json`` is in place, so a checkpoint is complete or absent. Leftovers of an
interrupted save are never loaded and are removed at the next save.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from automodel.checkpoint.paths import checkpoint_path, complete_checkpoints
from automodel.checkpoint.verify import CheckpointError, check_files, check_keys

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _part_states(parts, optimizers) -> list[tuple[dict, dict]]:
    return [get_state_dict(part, opt, options=OPTIONS)
            for part, opt in zip(parts, optimizers.optimizers)]


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


def _gather(obj) -> list:
    if dist.is_initialized() and dist.get_world_size() > 1:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


class Checkpointer:
    def __init__(self, root: str, keep_last: int | None, rank: int, faults=None):
        self.root = root
        self.keep_last = keep_last
        self.rank = rank
        self.faults = faults

    def path(self, step: int) -> str:
        return checkpoint_path(self.root, step)

    def save(self, step: int, parts, optimizers, scheduler, model_config=None,
             extra: dict | None = None, export_hf: bool = False) -> str:
        final = self.path(step)
        tmp = os.path.join(self.root, f".tmp-step_{step:08d}")
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):  # an earlier save that never finished
                if name.startswith((".tmp-", ".old-")):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        with _quiet_single_process():
            dcp.save(_merged(_part_states(parts, optimizers)), checkpoint_id=tmp,
                     no_dist=not dist.is_initialized())
        torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        if self.faults is not None:
            self.faults.in_save(step)
        _barrier()
        if self.rank == 0:
            if model_config is not None:
                with open(os.path.join(tmp, "model_config.json"), "w") as f:
                    json.dump(model_config, f, indent=1, sort_keys=True)
            meta = {"step": step, "scheduler": scheduler.state_dict(),
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    **(extra or {})}
            with open(os.path.join(tmp, "trainer.json"), "w") as f:
                json.dump(meta, f, indent=1)
            if export_hf:
                from automodel.checkpoint.hf_export import export_hf as export

                export(tmp, os.path.join(tmp, "hf"), (extra or {}).get("tokenizer_path"))
            old = os.path.join(self.root, f".old-step_{step:08d}")
            if os.path.isdir(final):  # the same step saved by an earlier run: keep it until
                os.replace(final, old)  # the new one is in place
            os.replace(tmp, final)  # the checkpoint appears whole
            shutil.rmtree(old, ignore_errors=True)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        if self.keep_last:
            for old in complete_checkpoints(self.root)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: str, parts, optimizers, scheduler) -> int:
        """Restore everything saved at ``path`` (any layout); returns the step it was saved
        after. Raises CheckpointError, naming the path and keys, before changing anything."""
        meta = check_files(path)
        states = _part_states(parts, optimizers)
        state = _merged(states)
        flat, _ = flatten_state_dict(state)
        model_keys = set().union(*_gather({k for k in flat if k.startswith("model.")}))
        try:
            check_keys(path, meta, flat, model_keys)
            problem = None
        except CheckpointError as err:
            problem = str(err)
        problems = [p for p in _gather(problem) if p]
        if problems:  # every rank raises the same error, none is left waiting
            raise CheckpointError(problems[0])
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
        for (m, o), part, opt in zip(states, parts, optimizers.optimizers):
            set_state_dict(part, opt, model_state_dict={k: state["model"][k] for k in m},
                           optim_state_dict={k: state["optim"][k] for k in o}, options=OPTIONS)
        with open(os.path.join(path, "trainer.json")) as f:
            trainer = json.load(f)
        scheduler.load_state_dict(trainer["scheduler"])
        rng = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.isfile(rng):  # (a rank the saving job did not have keeps its own)
            _set_rng_state(torch.load(rng))
        return int(trainer["step"])


__all__ = ["Checkpointer", "CheckpointError"]
