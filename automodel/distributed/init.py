"""Process-group initialization and the per-rank runtime facts."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    backend: str
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    timeout: datetime.timedelta = datetime.timedelta(minutes=1)  # of collectives in training
    startup_timeout: datetime.timedelta = datetime.timedelta(minutes=30)  # before, and in
    # rank 0's solo phases

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    hosts: tuple = ()  # each rank's hostname (several ranks: gathered at start-up)

    def describe(self) -> str:
        """Backend, device and, with several ranks, where they met and which ranks are on
        which node (for the start-up log)."""
        met = (f", rendezvous at {os.environ.get('MASTER_ADDR')}:{os.environ['MASTER_PORT']}"
               if self.world_size > 1 and "MASTER_PORT" in os.environ else "")
        if self.hosts:
            from automodel.config.nodes import ranks_by_node

            met += f", {ranks_by_node(list(self.hosts))}"
        threads = torch.get_num_threads()  # (launch_env.rank_threads: the same on every rank)
        return (f"backend {self.backend}, device {self.device.type}, {threads} CPU "
                f"thread{'s' if threads > 1 else ''} per rank{met}")

    def within(self, group) -> "DistInfo":
        """This rank's facts within ``group`` (a model's ranks): its rank there and their
        number, so that the model's first rank is the one that writes files."""
        if group is None:
            return self
        return dataclasses.replace(self, rank=dist.get_rank(group),
                                   world_size=dist.get_world_size(group))


def backend_and_device(backend: str | None, local_rank: int,
                       local_world: int = 1) -> tuple[str, torch.device]:
    """The rank's backend and device: null means nccl where CUDA is available, else gloo;
    ranks run on a GPU under nccl only, on the CPU under any other backend (so
    ``distributed.backend=gloo`` keeps a job on the CPU on a machine with GPUs). Which GPU:
    ``cuda:LOCAL_RANK`` where the node's ranks see all its GPUs, the one GPU a rank sees where
    the launcher gave each rank its own (``launch_env.cuda_device_index``)."""
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if use_cuda and backend == "nccl":
        from automodel.config.launch_env import cuda_device_index

        index = cuda_device_index(torch.cuda.device_count(), local_rank, local_world)
        return backend, torch.device("cuda", index)
    return backend, torch.device("cpu")


def init_distributed(backend: str | None, timeout_minutes: int, need_group: bool,
                     startup_timeout_minutes: int = 30) -> DistInfo:
    """Start the default process group from the launcher's env (RANK, WORLD_SIZE, ...).

    A single process that still needs a group (e.g. FSDP2 on one rank) gets an in-memory one.
    """
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend, device = backend_and_device(backend, local_rank,
                                         int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    # groups start with the longer start-up timeout; the runner lowers it after the first step
    startup = max(timeout, datetime.timedelta(minutes=startup_timeout_minutes))
    hosts: tuple = ()
    if not dist.is_initialized() and (world > 1 or need_group):
        extra = {"device_id": device} if device.type == "cuda" else {}
        if world > 1:
            from automodel.distributed.store import rendezvous_store

            dist.init_process_group(backend, rank=rank, world_size=world, timeout=startup,
                                    store=rendezvous_store(rank, world, startup), **extra)
            hosts = _hostnames(world)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=startup, **extra)
    return DistInfo(backend, device, rank, world, local_rank, timeout, startup, hosts)


def _hostnames(world: int) -> tuple:
    """Every rank's hostname, in rank order: one gather, by the ranks that just started the
    group together (a caller that brought its own group may call this on some ranks only)."""
    import socket

    names: list = [None] * world
    dist.all_gather_object(names, socket.gethostname())
    return tuple(names)


def set_collective_timeout(timeout: datetime.timedelta, group=None) -> None:
    """Give every process group of this rank (the default one, the mesh's, the pipeline's tie
    groups) this timeout. Collective over ``group`` (default: the world; the runner passes the
    model's group): its ranks first meet in a barrier under the old timeout, so a fast rank
    never waits for a slow one under the new, shorter one."""
    if not dist.is_initialized():
        return
    from automodel.compat import set_all_group_timeouts

    dist.barrier(group=group)
    set_all_group_timeouts(timeout, keep=_OWN_TIMEOUT)


# groups that keep the timeout they were made with (the background saver's: its write runs
# across training steps under checkpoint.save_timeout_minutes)
_OWN_TIMEOUT: list = []


def new_group_with_own_timeout(timeout: datetime.timedelta, desc: str):
    """A gloo group of every rank, whose timeout ``set_collective_timeout`` never changes."""
    group = dist.new_group(backend="gloo", group_desc=desc, timeout=timeout)
    _OWN_TIMEOUT.append(group)
    return group


def destroy_distributed() -> None:
    if dist.is_initialized():
        # Free wrapped models (DDP reducers, FSDP states) first: a group destroyed under a
        # live DDP reducer can abort the process in gloo's destructor.
        gc.collect()
        _OWN_TIMEOUT.clear()
        dist.destroy_process_group()
        from automodel.compat.torch_dist import forget_meshes

        forget_meshes()  # (DTensor's caches would keep the meshes' groups, and their sockets)
        gc.collect()
