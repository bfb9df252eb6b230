"""The job a plan is made for, without launching it: the environment its config is resolved
in (the ranks it will have, never this machine's GPUs), the overrides a plan or a search sets
itself, and the fork server its simulations start from."""

from __future__ import annotations

import os

from automodel.config.build import ConfigError
from automodel.config.plan_schema import PlanConfig


def planning_env(plan: PlanConfig, mesh_dp_size, nproc_per_node=None, env=None) -> dict:
    """The environment the config is resolved in: as if ``torchrun`` had started the job's
    ranks (the layout then fills the data-parallel degree), or a plain launch of the mesh's
    ranks; never this machine's GPUs. The job's size, as train.py takes it: ``plan.gpus``;
    else the mesh's own (``mesh.dp_size``) or the local ranks (``distributed.nproc_per_node``);
    else the ranks of the SLURM allocation or the torchrun world this runs in."""
    if plan.gpus is not None:
        if plan.gpus < 1:
            raise ConfigError(f"plan.gpus={plan.gpus}: the job's GPUs must be >= 1; set "
                              "plan.gpus=<GPUs>, or null to plan the mesh's ranks")
        return _world_env(plan.gpus, plan.gpus)
    if mesh_dp_size is not None or nproc_per_node is not None:
        return {"CUDA_VISIBLE_DEVICES": ""}
    found = _outer_world(os.environ if env is None else env)
    if found is None:
        raise ConfigError("plan.py needs the job's size: set plan.gpus=<GPUs> (the mesh's "
                          "data-parallel degree is then inferred), distributed.nproc_per_node "
                          "(local ranks) or mesh.dp_size, or run it inside the SLURM "
                          "allocation or torchrun job it plans")
    return _world_env(*found)


def _world_env(world: int, per_node: int) -> dict:
    return {"TORCHELASTIC_RUN_ID": "plan", "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node), "RANK": "0", "CUDA_VISIBLE_DEVICES": ""}


def _outer_world(env) -> tuple[int, int] | None:
    """(ranks, ranks per node) of the SLURM allocation (its tasks) or torchrun job this runs
    in, or None."""
    if env.get("SLURM_JOB_ID") and env.get("SLURM_NTASKS"):
        from automodel.config.slurm_env import expand_tasks_per_node

        per_node = expand_tasks_per_node(env.get("SLURM_TASKS_PER_NODE",
                                                 env["SLURM_NTASKS"]))
        return int(env["SLURM_NTASKS"]), max(per_node)
    if env.get("WORLD_SIZE"):
        return int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE") or env["WORLD_SIZE"])
    return None


def without_keys(overrides: list[str], prefixes: tuple) -> list[str]:
    """``overrides`` without those whose key starts with one of ``prefixes`` (``+``/``~``
    forms too): the keys a plan, a probe or a searched layout sets itself."""
    return [o for o in overrides if not o.lstrip("+~").startswith(prefixes)]


# What a simulation worker imports beyond the fork server's own list (``runtime/forkserver.py``):
# the planner, the step it runs and the torch parts it simulates (a second of CPU per worker)
SIMULATION_PRELOAD = ("automodel.planning.plan", "automodel.planning.simulate",
                      "automodel.recipes.pipeline_step", "torch.distributed.pipelining",
                      "torch.distributed.fsdp", "torch.distributed.tensor",
                      "torch.distributed._tools.mem_tracker",
                      "torch.distributed._tools.fake_collectives")


def simulation_modules(model_type: str | None) -> tuple:
    """``SIMULATION_PRELOAD`` and the transformers modeling module of ``model_type``: the one
    list the fork server of the simulations starts with (it takes effect once per process, so
    whoever starts the server first must name all of it)."""
    if not model_type:
        return SIMULATION_PRELOAD
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    return (*SIMULATION_PRELOAD, f"transformers.models.{name}.modeling_{name}")


def start_simulation_server(cfg) -> None:
    """Start the fork server that the simulation workers are forked from now, with what they
    import (torch, transformers, the planner, the model's modeling file) preloaded: its
    imports then run beside the config checks instead of before the first simulation, and no
    worker imports anything again. ``cfg``: a composed config (its ``model.config``)."""
    from automodel.runtime import forkserver

    model_type = (cfg.model.get("config") or {}).get("model_type")
    forkserver.context(simulation_modules(str(model_type) if model_type else None))
