"""Save and load training state with torch.distributed.checkpoint (each rank writes its shards).

A checkpoint is the directory ``<dir>/step_<NNNNNNNN>``: model and optimizer (through the
distributed state-dict helpers, so any sharding), plus ``trainer.json`` (step, LR scheduler)
and ``rng_rank<R>.pt``. It is written under a ``.tmp-`` name and renamed by rank 0 once every
rank has finished, so a checkpoint is complete or absent; leftovers of an interrupted save are
ignored and removed at the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_NAME = re.compile(r"^step_(\d{8})$")


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _NAME.match(n)
                   and os.path.isfile(os.path.join(root, n, "trainer.json")))
    return [os.path.join(root, n) for n in names]


class Checkpointer:
    def __init__(self, root: str, keep_last: int | None, rank: int):
        self.root = root
        self.keep_last = keep_last
        self.rank = rank

    def save(self, step: int, model, optimizer, scheduler) -> str:
        final = os.path.join(self.root, f"step_{step:08d}")
        tmp = os.path.join(self.root, f".tmp-step_{step:08d}")
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):  # an earlier save that never finished
                if name.startswith(".tmp-"):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        torch.save({"cpu": torch.get_rng_state()}, os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        _barrier()
        if self.rank == 0:
            with open(os.path.join(tmp, "trainer.json"), "w") as f:
                json.dump({"step": step, "scheduler": scheduler.state_dict()}, f)
            os.replace(tmp, final)  # the checkpoint appears whole
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        if self.keep_last:
            for old in complete_checkpoints(self.root)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: str, model, optimizer, scheduler) -> int:
        """Restore everything saved at ``path``; returns the step it was saved after."""
        meta_path = os.path.join(path, "trainer.json")
        if not os.path.isfile(meta_path):
            raise ValueError(f"checkpoint.resume={path!r}: not a complete checkpoint "
                             "(no trainer.json)")
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        with open(meta_path) as f:
            meta = json.load(f)
        scheduler.load_state_dict(meta["scheduler"])
        rng = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.isfile(rng):
            torch.set_rng_state(torch.load(rng)["cpu"])
        return int(meta["step"])
