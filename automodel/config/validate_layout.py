"""Validation of the layout (no torch): how many ranks the job gets, the ``Layout`` on them,
and what the strategy and the GPUs allow of it. The arithmetic itself is ``layout.py``'s;
``resolve.py`` calls ``resolve_layout`` and ``resolve_trainer``.
"""

from __future__ import annotations

import dataclasses
import logging

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.config.layout import Layout, MeshRequest
from automodel.config.strategies import Strategy
from automodel.config.strategies import strategy as strategy_of

log = logging.getLogger(__name__)


def resolve_layout(strategy: Strategy | str, m: s.MeshConfig, launch, d: s.DistributedConfig,
                   pipeline_chosen: bool) -> Layout:
    """The job's ``Layout``: the mesh config on the world size (set by the outer launcher or
    ``distributed.nproc_per_node``, else inferred), checked against the strategy (its entry or
    name) and the GPUs. ``launch``: the ``LaunchEnv`` (who started the ranks, how many GPUs are
    visible). A strategy of more than one process gets 2 data-parallel ranks by default."""
    strategy = strategy_of(strategy)
    request = MeshRequest.of(m, pipeline_chosen)
    # Local ranks that init_distributed puts one per GPU (cuda:LOCAL_RANK): backend nccl, which
    # null means when GPUs are visible. torchrun and SLURM place their ranks themselves.
    on_gpus = (launch.kind == "local" and not strategy.one_process
               and (d.backend or ("nccl" if launch.gpus else "gloo")) == "nccl")
    world, source, note = _world_size(strategy, request, launch, d, on_gpus)
    layout = request.layout(world, source, note)
    if strategy.one_process and layout.world_size > 1:
        raise ConfigError(f"parallelism={strategy.name} runs one process but the mesh asks for "
                          f"{layout.world_size} ranks (dp={layout.dp}, tp={layout.tp}, "
                          f"cp={layout.cp}, pp={layout.pp}); choose parallelism=ddp or fsdp2")
    if on_gpus and layout.world_size > launch.gpus:
        _too_many_ranks(layout, launch.gpus, d, m.dp_size is not None)
    strategy.check_layout(strategy.name, layout)  # the degrees the strategy supports
    return layout


def _world_size(strategy: Strategy, request: MeshRequest, launch, d: s.DistributedConfig,
                on_gpus: bool) -> tuple:
    """(the number of ranks, where it comes from, a note for the HSDP message)."""
    world = launch.world_size
    if (world is not None and d.nproc_per_node is not None
            and d.nproc_per_node != launch.local_world_size):
        log.warning("distributed.nproc_per_node=%s ignored: %s started %s processes on this node",
                    d.nproc_per_node, launch.kind, launch.local_world_size)
    if world is None:
        world = d.nproc_per_node
    if world is not None:
        return world, (f"distributed.nproc_per_node={world}" if launch.kind == "local"
                       else f"the world size {world} set by {launch.kind}"), ""
    non_dp, gpus = request.model_parallel, launch.gpus
    if request.dp is not None:
        return request.dp * non_dp, "the mesh", ""
    if on_gpus and gpus >= non_dp:  # one rank per visible GPU
        if gpus % non_dp:
            raise ConfigError(
                f"the {gpus} visible GPUs (CUDA_VISIBLE_DEVICES, /dev/nvidia<N>) cannot "
                "be split into data-parallel groups of "
                f"mesh.tp_size*cp_size*pp_size = {request.product} = {non_dp} "
                "ranks; set distributed.nproc_per_node (a multiple of "
                f"{non_dp}, at most {gpus}) or mesh.dp_size to use fewer GPUs")
        return gpus, "the visible GPUs", f"one rank per GPU: {_gpus(gpus)}"
    if request.dp_replicate > 1:
        dp = 2 * request.dp_replicate
    elif not strategy.one_process and non_dp == 1:
        dp = 2
    else:
        dp = 1
    return dp * non_dp, "the mesh", ""


def _too_many_ranks(layout: Layout, gpus: int, d: s.DistributedConfig, dp_set: bool) -> None:
    ranks, non_dp = layout.world_size, layout.model_parallel
    asked = (f"distributed.nproc_per_node={d.nproc_per_node}" if d.nproc_per_node is not None
             else f"the mesh (mesh.dp_size*tp_size*cp_size*pp_size = {layout.dp}*{layout.tp}*"
                  f"{layout.cp}*{layout.pp})")
    backend = (f"distributed.backend={d.backend}" if d.backend
               else "distributed.backend=null (nccl when GPUs are visible)")
    fewer = ""
    if gpus >= non_dp:
        fewer = (f"use at most {gpus} ranks (e.g. "
                 + (f"mesh.dp_size={gpus // non_dp}" if dp_set and d.nproc_per_node is None
                    else f"distributed.nproc_per_node={gpus // non_dp * non_dp}")
                 + ") or ")
    raise ConfigError(f"{asked} asks for {ranks} local ranks but {_gpus(gpus)}, and {backend} "
                      f"runs one rank per GPU; {fewer}use distributed.backend=gloo (ranks on CPU)")


def _gpus(n: int) -> str:
    return (f"{n} GPU{'' if n == 1 else 's'} {'is' if n == 1 else 'are'} visible "
            "(CUDA_VISIBLE_DEVICES, /dev/nvidia<N>)")


def resolve_trainer(t: s.TrainerConfig, layout: Layout) -> s.TrainerConfig:
    """A copy of ``t`` with ``local_batch_size`` resolved; the batch and the sequence checked
    against the layout's divisors."""
    for name in ("max_steps", "global_batch_size", "local_batch_size", "seq_len", "log_every"):
        value = getattr(t, name)
        if value is not None and value < 1:
            raise ConfigError(f"trainer.{name}={value}: must be >= 1")
    layout.check_seq_len(t.seq_len)
    local = layout.local_batch_size(t.global_batch_size, t.local_batch_size)
    return dataclasses.replace(t, local_batch_size=local)
