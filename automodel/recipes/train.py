"""The training runner, executed on every rank with the same resolved ``TrainConfig``.

build model -> parallelize -> optimizer, scheduler -> data plan -> loop -> metrics

The components are built in ``recipes/components.py``, the steps run in ``recipes/loop.py``
and the run ends in ``recipes/finish.py``; this file sets up the mesh, the output directory
and the log, and calls them in order.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist

from automodel.compat import FLIGHT_RECORDER_ENV
from automodel.config.launch_env import rank_threads, usable_cpus
from automodel.config.resolve import TrainConfig
from automodel.distributed.context_parallel import build_context_parallel
from automodel.distributed.init import DistInfo, destroy_distributed, init_distributed
from automodel.distributed.mesh import MeshAxis, MeshContext, build_mesh_for
from automodel.distributed.setup import DistributedSetup, named_hook
from automodel.recipes.components import build_components, restore
from automodel.recipes.finish import close, raise_if_stopped, save_last
from automodel.recipes.loop import run_steps, start_run
from automodel.runtime.failure import keep_tracebacks_in, set_phase

log = logging.getLogger("automodel")


class LogFileHandler(logging.FileHandler):
    """``train.log``: a failed write (a full disk) is said once, naming the file and the
    cause, and training goes on (the console still has the log)."""

    failed = False

    def handleError(self, record) -> None:
        if self.failed:
            return
        self.failed = True
        err = sys.exc_info()[1]
        print(f"automodel: cannot write {self.baseFilename}: {type(err).__name__}: {err}; "
              "the log goes on only on the console", file=sys.stderr, flush=True)


def _setup_logging(output_dir: str, info: DistInfo) -> list[logging.Handler]:
    """Rank 0 logs to the console and ``train.log``; returns the handlers it added."""
    root = logging.getLogger()
    added: list[logging.Handler] = []
    if info.is_main:
        log_file = os.path.abspath(os.path.join(output_dir, "train.log"))
        if not any(getattr(h, "baseFilename", None) == log_file for h in root.handlers):
            os.makedirs(output_dir, exist_ok=True)
            fh = LogFileHandler(log_file)
            fh.setFormatter(logging.Formatter(
                "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
            added.append(fh)
        if not any(type(h) is logging.StreamHandler for h in root.handlers):
            added.append(logging.StreamHandler())
        for h in added:
            root.addHandler(h)
        root.setLevel(logging.INFO)
        # Rank 0 only reads the model output (no in-place ops), so this FSDP2 caution is noise.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    else:  # other ranks stay quiet unless something fails
        root.setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
    return added


def _agree_output_dir(output_dir: str, setup: DistributedSetup) -> str:
    """Under torchrun every rank composed its own config: the model's rank 0's dir wins."""
    if setup.dist.world_size > 1:
        box = [output_dir]
        dist.broadcast_object_list(box, group=setup.process_group, group_src=0)
        return box[0]
    return output_dir


def build_setup(cfg: TrainConfig, info: DistInfo, mesh: MeshContext | None = None
                ) -> DistributedSetup:
    """``mesh``: the model's mesh, built beforehand when the job holds other models on other
    ranks (see ``train``); by default one over every rank. ``setup.dist`` counts ranks within
    the mesh."""
    if mesh is not None:
        _check_mesh(cfg, mesh)
    elif dist.is_initialized():
        # groups start with the start-up timeout; set_collective_timeout lowers it later
        mesh = build_mesh_for(cfg.layout, info.device.type, info.backend,
                              info.startup_timeout.total_seconds() / 60)
    return DistributedSetup(
        strategy=cfg.strategy, options=cfg.parallelism,
        dist=info.within(None if mesh is None else mesh.group), mesh=mesh,
        activation_checkpointing=cfg.activation_checkpointing,
        activation_checkpointing_scope=cfg.activation_checkpointing_scope,
        mp_policy=cfg.mp_policy, offload_policy=cfg.offload_policy, pipeline=cfg.pipeline,
        cp=build_context_parallel(mesh),
        pre_shard_hook=named_hook(getattr(cfg.parallelism, "pre_shard_hook", None)),
        loss=cfg.trainer.loss, loss_chunk_tokens=cfg.trainer.loss_chunk_tokens)


def _check_mesh(cfg: TrainConfig, mesh: MeshContext) -> None:
    layout = cfg.layout
    want = {axis: layout.size(axis) for axis in (MeshAxis.PP, MeshAxis.DP, MeshAxis.CP,
                                                 MeshAxis.TP)}
    got = {axis: mesh.size(axis) for axis in want}
    if got != want or layout.ep_enabled != (mesh.moe is not None):
        raise ValueError(f"the mesh given to train() has {_sizes(got)} (expert parallelism "
                         f"{'on' if mesh.moe is not None else 'off'}); the config's mesh is "
                         f"{_sizes(want)} with ep_size={layout.ep}: build the mesh from it")


def _sizes(sizes: dict) -> str:
    return ", ".join(f"{axis.value}={n}" for axis, n in sizes.items())


def train(cfg: TrainConfig, info: DistInfo, mesh: MeshContext | None = None) -> list[dict]:
    """Train on this rank. ``mesh``: when the job holds other models on other ranks (a frozen
    reference, a teacher), this model's mesh over its ranks only (``build_mesh(ranks=...)``,
    built by every rank of the job); only those ranks call ``train``. Its collectives stay
    inside the mesh's group and the model's first rank writes the files."""
    setup = build_setup(cfg, info, mesh)
    output_dir = _agree_output_dir(cfg.output_dir, setup)
    keep_tracebacks_in(output_dir)  # (a rank that fails from here writes its traceback there)
    handlers = _setup_logging(output_dir, setup.dist)
    try:
        return _train(cfg, setup, output_dir)
    finally:
        for h in handlers:
            logging.getLogger().removeHandler(h)
            h.close()


def _train(cfg: TrainConfig, setup: DistributedSetup, output_dir: str) -> list[dict]:
    """Build the components, load the checkpoint to resume from, run the steps, finish."""
    if getattr(cfg.parallelism, "patch_is_packed_sequence", False):
        from automodel.compat import patch_is_packed_sequence

        patch_is_packed_sequence()
    parts = build_components(cfg, setup, output_dir)
    set_phase("checkpoint load")
    run = start_run(cfg, setup, parts, output_dir, restore(cfg, parts))
    try:
        with run.steplog.logging_redirect():
            run_steps(run)
        save_last(run)
    except BaseException:
        close(run, failed=True)
        raise
    else:
        close(run, failed=False)
    raise_if_stopped(run)
    return run.steplog.records


def run_rank(cfg: TrainConfig) -> list[dict] | None:
    """Entry point of one rank (local spawn, torchrun or in-process). Rank 0 returns records."""
    # (a rank forked from the fork server kept the server's thread count: set it here)
    torch.set_num_threads(rank_threads(os.environ, usable_cpus(),
                                       int(os.environ.get("LOCAL_WORLD_SIZE") or 1)))
    if cfg.trainer.profile_steps:  # the flight recorder keeps each collective's group
        os.environ.setdefault(FLIGHT_RECORDER_ENV, "20000")
    set_phase("process group start")
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_minutes,
                            startup_timeout_minutes=cfg.distributed.startup_timeout_minutes,
                            need_group=not cfg.strategy.one_process)
    try:
        records = train(cfg, info)
        if dist.is_initialized():
            dist.barrier()
        return records if info.is_main else None
    finally:
        destroy_distributed()
