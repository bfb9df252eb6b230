"""Internals of torch.distributed (process groups, meshes, DTensor, pipelining, checkpoint) and
inductor that automodel patches or reads."""

from __future__ import annotations

import contextlib
import datetime

from automodel.compat.core import Internal

_C10D = "torch.distributed.distributed_c10d"
_DCP_PROCESS = "torch.distributed.checkpoint._async_process_executor"


def _gloo_options():
    import torch.distributed as dist

    return dist.ProcessGroupGloo._Options()


INTERNALS = [
    Internal(_C10D, "_set_pg_timeout", "distributed.timeout_minutes (the timeout lowered "
             "after start-up, raised around saves)", patched=False,
             params=("timeout", "group")),
    Internal(_C10D, "_world.pg_map", "distributed.timeout_minutes (every group of the rank)",
             patched=False, kind=dict),
    Internal("torch.distributed", "ProcessGroupGloo._Options", "distributed.timeout_minutes "
             "(the timeout of every mesh sub-group)", patched=False, params=()),
    Internal("torch.distributed.ProcessGroupGloo._Options()", "_timeout",
             "distributed.timeout_minutes (the timeout of every mesh sub-group)",
             probe=_gloo_options, kind=datetime.timedelta),
    Internal("torch.distributed.device_mesh", "DeviceMesh._get_mesh_tensor_from_full_mesh",
             "several models in one job (a mesh built on ranks outside it)",
             params=("full_mesh", "current_rank")),
    Internal("torch.distributed.device_mesh", "DeviceMesh._flatten", "the flattened mesh "
             "axes (dp_shard_cp, dp_cp, ...)", patched=False,
             params=("self", "mesh_dim_name", "backend_override")),
    Internal("torch._inductor.config", "_micro_pipeline_tp",
             "parallelism.enable_async_tensor_parallel", kind=bool),
    Internal("torch.distributed._symmetric_memory", "enable_symm_mem_for_group",
             "parallelism.enable_async_tensor_parallel (CUDA)", patched=False,
             params=("group_name",)),
    Internal("torch.distributed.tensor", "DTensor._local_tensor", "copying into a DTensor's "
             "shard in place (loading weights, tied pipeline embeddings)", patched=False),
    Internal("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
             "loading weights into sharded parameters", patched=False,
             params=("global_shape", "mesh", "placements")),
    Internal("torch.distributed.checkpoint._nested_dict", "flatten_state_dict",
             "checkpoint save and resume (flat state keys)", patched=False,
             params=("state_dict",)),
    Internal(_DCP_PROCESS, "_CHECKPOINT_PROCESS", "checkpoint.async_mode=process (its writer "
             "process ended with the job)"),
    Internal(_DCP_PROCESS, "_AsyncCheckpointProcess.__del__", "checkpoint.async_mode=process "
             "(its writer process ended with the job)", patched=False, params=("self",)),
]


def stop_checkpoint_writer() -> None:
    """End the writer process that DCP's process-based async save starts once per rank and
    otherwise keeps until the rank's interpreter exits, with its process group and its store
    (a port open, on every interface, after the job; a process left behind in a long-lived
    Python). Its own teardown asks it to stop, waits 5 s, then terminates it. No-op when none
    was started."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    if process is not None:
        process.__del__()


def set_all_group_timeouts(timeout: datetime.timedelta, keep=()) -> None:
    """Give every process group of this rank (default, mesh and sub-groups) ``timeout``, but
    those of ``keep``."""
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        if not any(pg is k for k in keep):
            c10d._set_pg_timeout(timeout, pg)


def new_gloo_options():
    """Options for a new gloo group (``new_group``, ``DeviceMesh``)."""
    return _gloo_options()


def set_options_timeout(opts, timeout: datetime.timedelta) -> None:
    """Set ``timeout`` on process-group options (gloo's private or NCCL's public ones)."""
    opts._timeout = timeout


@contextlib.contextmanager
def building_mesh_outside_this_rank():
    """While this rank builds a DeviceMesh it is not part of (another model's mesh, in a job
    that holds several models): torch creates each process group of a mesh with every rank of
    the job, so this rank must build the mesh too. Torch keeps such a rank outside (no
    coordinate, no groups), but slicing or flattening a mesh of several rows asks for the row
    that holds this rank, and raises. Any row serves its checks there (sizes only): the first."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__["_get_mesh_tensor_from_full_mesh"]

    def any_row(full_mesh, current_rank=None):
        try:
            return original.__func__(full_mesh, current_rank)
        except RuntimeError:  # (this rank holds no row)
            return full_mesh[0]

    DeviceMesh._get_mesh_tensor_from_full_mesh = staticmethod(any_row)
    try:
        yield
    finally:
        DeviceMesh._get_mesh_tensor_from_full_mesh = original


def enable_micro_pipeline_tp() -> None:
    """Let inductor overlap TP collectives with matmuls in compiled regions."""
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True


def enable_symmetric_memory(group_name: str) -> None:
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(group_name)


def flatten_mesh(mesh, name: str, backend_override):
    """One flattened view of ``mesh`` (all its axes), named ``name``."""
    return mesh._flatten(name, backend_override=backend_override)


def local_tensor(t):
    """A DTensor's local shard itself (not a view through autograd, as ``to_local`` gives)."""
    return t._local_tensor


def local_shape_and_offset(shape, mesh, placements):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def flatten_state_dict(state: dict):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state)


_TENSOR = "torch.distributed.tensor"
_MESH_CACHES = ("a job's meshes (DTensor's caches keyed by mesh, emptied when the process "
                "group ends and between plan.py's simulations)")
INTERNALS += [
    Internal(f"{_TENSOR}._sharding_prop", "ShardingPropagator.propagate_op_sharding",
             _MESH_CACHES, patched=False, assigned_in=True),
    Internal(f"{_TENSOR}._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached",
             _MESH_CACHES, patched=False, params=("self", "op_schema")),
    Internal(f"{_TENSOR}._redistribute", "_gen_transform_infos", _MESH_CACHES, patched=False,
             params=("src_spec", "dst_spec")),
    Internal(f"{_TENSOR}._redistribute", "clear_redistribute_planner_cache", _MESH_CACHES,
             patched=False, params=()),
    Internal(f"{_TENSOR}._collective_utils", "MeshTopoInfo.build_from_mesh", _MESH_CACHES,
             patched=False, params=("mesh",)),
    Internal("torch._C", "_clear_DTensor_sharding_propagator_cache", _MESH_CACHES,
             patched=False, check=lambda f: None if callable(f) else "not callable"),
]


def forget_meshes() -> None:
    """Empty DTensor's caches keyed by meshes. They hold the meshes, and so the meshes'
    process groups (each a listening socket under gloo) after the job's group is destroyed;
    and a mesh equals any earlier mesh of the same shape and names, so in a process that
    simulates again, a cached sharding would hand the new job an earlier job's mesh, whose
    process groups are destroyed."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import (
        _gen_transform_infos,
        clear_redistribute_planner_cache,
    )

    torch._C._clear_DTensor_sharding_propagator_cache()  # (DTensor's dispatch in C++)
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
