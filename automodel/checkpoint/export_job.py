"""The Hugging Face export a job writes with a checkpoint (``checkpoint.export_hf``): the first
rank of each host writes its share of the files (``export_layout.ExportLayout.mine``), so the
hosts write in parallel and none holds more than one file and one layer at a time; the ranks
learn whether every writer succeeded; the model's rank 0 then finishes it
(``hf_export.ExportJob.finish``)."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from automodel.errors import CheckpointWriteError, describe


def writer_slot(hosts: list[str], rank: int) -> tuple[int, int] | None:
    """(place, writers) for a rank that is the first of its host among ``hosts`` (each rank's
    host, in rank order), else None: one writer per host, in host order."""
    firsts = [r for r, host in enumerate(hosts) if host not in hosts[:r]]
    return (firsts.index(rank), len(firsts)) if rank in firsts else None


def _gather(obj, group) -> list:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return [obj]


class JobExport:
    """``dtype`` (None: the model's source dtype) and ``max_shard_size`` of the export."""

    def __init__(self, dtype: str | None, max_shard_size: str):
        self.dtype, self.max_shard_size = dtype, max_shard_size
        self.writer: tuple[int, int] | None = None
        self._placed = False

    def place(self, group, rank: int) -> None:
        """Learn this rank's place among the writers (collective over ``group`` the first
        time: every rank of the model calls it with the same save)."""
        if not self._placed:
            self.writer = writer_slot(_gather(socket.gethostname(), group), rank)
            self._placed = True

    def write_share(self, tmp: str, model_config: dict | None, trainer: dict, step: int,
                    group, rank: int):
        """Write this rank's files into ``<tmp>/hf.tmp`` (collective over ``group``); every
        rank raises if any writer failed. Returns the export job on a writer, else None."""
        from automodel.checkpoint.hf_export import ExportJob, staging_dir

        if rank == 0:
            staging_dir(os.path.join(tmp, "hf"))
        _gather(None, group)  # (a barrier: the folder exists before anyone writes)
        export, problem = None, None
        try:
            if self.writer is not None:
                export = ExportJob(tmp, self.dtype, self.max_shard_size, config=model_config,
                                   trainer=trainer)
                export.write(os.path.join(tmp, "hf.tmp"), export.layout.mine(*self.writer))
        except Exception as err:
            problem = f"rank {rank}: {describe(err)}"
        problems = [p for p in _gather(problem, group) if p]
        if problems:
            raise CheckpointWriteError(f"the Hugging Face export of step {step}'s checkpoint "
                                       f"failed: {'; '.join(problems)}")
        return export
