"""The layout of a job's ranks: every parallel degree, in one torch-free object.

``Layout`` (cf. torchtitan's ``ParallelDims``) is built once, at config time, from the mesh
config and the world size (``MeshRequest.of(mesh, ...).layout(world, ...)``). It owns the
degrees (the inferred ones too), the flattened axes, the MoE regrouping, the ``*_enabled`` flags
and the divisors of the batch and of the sequence. Config validation, the device mesh
(``distributed/mesh.py``) and the runner read it; nothing else computes a size.

Mesh order (outermost first): ``pp x dp_replicate x dp_shard x cp_ring x cp_ulysses x tp``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from automodel.config.build import ConfigError

BASE_AXES = ("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "tp")
_CP = ("cp_ring", "cp_ulysses")
FLATTENED = {  # a flattened view -> the base axes it joins
    "dp": ("dp_replicate", "dp_shard"),  # ranks that see different data
    "cp": _CP,  # ranks holding parts of the same sequences
    "dp_shard_cp": ("dp_shard", *_CP),  # FSDP shards parameters over these
    "dp_cp": ("dp_replicate", "dp_shard", *_CP),  # gradients and the loss are averaged over these
}
# Under expert parallelism the dp x cp x tp ranks of each stage are regrouped as ep_shard x ep;
# ep_unit (size 1) is the shard dim of an (ep_shard, ep_unit) mesh that replicates the experts
# over ep_shard instead of sharding them (parallelism.moe.shard_experts=false).
MOE_AXES = ("pp", "ep_shard", "ep_unit", "ep")
MESH_KEYS = ("dp_size", "dp_replicate_size", "tp_size", "cp_size", "cp_ulysses_size", "pp_size",
             "ep_size")


@dataclass(frozen=True)
class Layout:
    """Every degree of the mesh; the rest is derived. Picklable, immutable."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1  # cp_ring x cp_ulysses
    cp_ulysses: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "cp_ulysses", "tp", "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Layout.{name}={getattr(self, name)!r}: must be an int >= 1")
        if self.cp % self.cp_ulysses:
            raise ValueError(f"{self}: cp_ulysses={self.cp_ulysses} must divide cp={self.cp}")
        if self.per_stage % self.ep:
            raise ValueError(f"{self}: ep={self.ep} must divide dp*cp*tp={self.per_stage}")

    @classmethod
    def of(cls, mesh) -> "Layout":
        """The layout of a resolved ``MeshConfig`` (every size set), rebuilt identically."""
        replicate = mesh.dp_replicate_size or 1
        return cls(pp=mesh.pp_size, dp_replicate=replicate, dp_shard=mesh.dp_size // replicate,
                   cp=mesh.cp_size, cp_ulysses=mesh.cp_ulysses_size or 1, tp=mesh.tp_size,
                   ep=mesh.ep_size)

    def resolved(self, mesh):
        """``mesh`` (a ``MeshConfig``) with the inferred sizes filled in (a copy)."""
        return dataclasses.replace(mesh, dp_size=self.dp, dp_replicate_size=self.dp_replicate,
                                   pp_size=self.pp)

    # ------------------------------------------------------------------ degrees and axes
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def cp_ring(self) -> int:
        return self.cp // self.cp_ulysses

    @property
    def dp_shard_cp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the data: tp x cp x pp."""
        return self.tp * self.cp * self.pp

    @property
    def per_stage(self) -> int:
        """Ranks of one pipeline stage: dp x cp x tp."""
        return self.dp * self.cp * self.tp

    @property
    def ep_shard(self) -> int:
        """The ranks of a stage holding the same experts (the stage's ranks / ep)."""
        return self.per_stage // self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.per_stage

    def canonical_axis(self, axis: str) -> str:
        """The name of the ranks an axis joins: a flattened view over one axis of size > 1
        is that axis (``dp_shard_cp`` without cp is ``dp_shard``); others keep their name.
        The planner and the measured collectives key bytes by it."""
        axis = getattr(axis, "value", axis)
        if axis not in FLATTENED:
            return axis
        used = [a for a in FLATTENED[axis] if self.size(a) > 1]
        return used[0] if len(used) == 1 else axis

    def axes_across_nodes(self, node_of_rank) -> list[str]:
        """The axes that should stay within a node (tp, cp and, under HSDP, dp_shard: their
        collectives run every layer) but have a group whose ranks are on different nodes;
        ``node_of_rank[r]``: rank r's node (any label)."""
        strides, stride = {}, 1
        for axis in reversed(BASE_AXES):
            strides[axis] = stride
            stride *= self.size(axis)
        keep = [a for a in ("tp", "cp_ulysses", "cp_ring") if self.size(a) > 1]
        if self.dp_replicate > 1 and self.dp_shard > 1:
            keep.append("dp_shard")
        split = []
        for axis in keep:
            step, n = strides[axis], self.size(axis)
            starts = (r for r in range(self.world_size) if (r // step) % n == 0)
            if any(len({node_of_rank[r + k * step] for k in range(n)}) > 1 for r in starts):
                split.append(axis)
        return split

    def size(self, axis: str) -> int:
        """The size of a base axis, a flattened view, or an axis of the MoE mesh."""
        axis = getattr(axis, "value", axis)
        if axis in FLATTENED:
            n = 1
            for part in FLATTENED[axis]:
                n *= self.size(part)
            return n
        if axis == "ep_unit":
            return 1
        return getattr(self, axis)

    @property
    def shape(self) -> tuple:
        """The mesh's shape, in ``BASE_AXES`` order."""
        return tuple(self.size(a) for a in BASE_AXES)

    @property
    def moe_shape(self) -> tuple:
        """The MoE mesh's shape, in ``MOE_AXES`` order: each stage's ranks as ep_shard x ep."""
        return tuple(self.size(a) for a in MOE_AXES)

    # ------------------------------------------------------------------ flags
    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:  # HSDP (or replicated Megatron-FSDP)
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters sharded (over dp_shard x cp)."""
        return self.dp_shard_cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    # ------------------------------------------------------------------ batch divisors
    def local_batch_size(self, global_batch_size: int, local: Optional[int] = None) -> int:
        """``trainer.local_batch_size`` (null: the whole per-rank batch), checked against dp."""
        dp = self.dp
        if local is None:
            if global_batch_size % dp:
                raise ConfigError(f"trainer.global_batch_size={global_batch_size} must be "
                                  f"divisible by the data-parallel size dp={dp}")
            local = global_batch_size // dp
        if global_batch_size % (local * dp):
            raise ConfigError(
                f"trainer.global_batch_size={global_batch_size} must be divisible by "
                f"trainer.local_batch_size * dp = {local}*{dp} = {local * dp} (the remainder "
                "would be silently dropped); change one of them")
        return local

    def per_rank_batch(self, global_batch_size: int) -> int:
        """Sequences each data-parallel rank takes per step."""
        return global_batch_size // self.dp

    def grad_accum_steps(self, global_batch_size: int, local_batch_size: int) -> int:
        """Micro-batches per rank per step (without a pipeline)."""
        return global_batch_size // (local_batch_size * self.dp)

    def pipeline_batch(self, global_batch_size: int, pp_batch_size: Optional[int]) -> int:
        """The batch one pipeline schedule step takes (default: the per-rank batch)."""
        return pp_batch_size if pp_batch_size is not None else self.per_rank_batch(
            global_batch_size)

    def pipeline_microbatches(self, global_batch_size: int, pp_batch_size: Optional[int],
                              pp_microbatch_size: int) -> int:
        return self.pipeline_batch(global_batch_size, pp_batch_size) // pp_microbatch_size

    # ------------------------------------------------------------------ sequence divisors
    def seq_len_divisor(self, sequence_parallel: bool = False) -> int:
        """What ``trainer.seq_len`` must be a multiple of: 2 * cp (two equal chunks per
        context-parallel rank), and cp * tp under sequence parallelism."""
        chunks = 2 * self.cp if self.cp_enabled else 1
        shards = self.cp * self.tp if sequence_parallel and self.tp_enabled else 1
        return math.lcm(chunks, shards)

    def local_seq_len(self, seq_len: int) -> int:
        """Tokens of each sequence on one context-parallel rank."""
        return seq_len // self.cp

    def check_seq_len(self, seq_len: int) -> None:
        """Context parallelism cuts every sequence into 2 * cp equal chunks."""
        cp = self.cp
        if cp > 1 and seq_len % (2 * cp):
            fit = seq_len // (2 * cp) * 2 * cp
            raise ConfigError(
                f"trainer.seq_len={seq_len} must be divisible by 2 * mesh.cp_size = {2 * cp}: "
                f"each of the {cp} context-parallel ranks holds two equal chunks of every "
                f"sequence; use trainer.seq_len={fit or 2 * cp}"
                + (f" or {fit + 2 * cp}" if fit else ""))

    def check_sequence_parallel_seq_len(self, seq_len: int) -> None:
        """Sequence parallelism splits each cp rank's tokens over the tp ranks."""
        cp, tp = self.cp, self.tp
        if tp > 1 and self.local_seq_len(seq_len) % tp:
            split = f" / mesh.cp_size={cp} = {seq_len // cp} per cp rank" if cp > 1 else ""
            raise ConfigError(f"trainer.seq_len={seq_len}{split} must be divisible by "
                              f"mesh.tp_size={tp} with parallelism.sequence_parallel=true")


@dataclass(frozen=True)
class MeshRequest:
    """What the mesh config asks for before the world size is known (``pp`` already decided:
    2 when a pipeline schedule is chosen and ``mesh.pp_size`` is null)."""

    dp: Optional[int]  # null: inferred from the world size
    dp_replicate: int
    tp: int
    cp: int
    cp_ulysses: int
    pp: int
    ep: int

    @classmethod
    def of(cls, mesh, pipeline_chosen: bool) -> "MeshRequest":
        for name in MESH_KEYS:
            value = getattr(mesh, name)
            if value is not None and value < 1:
                raise ConfigError(f"mesh.{name}={value}: must be >= 1")
        pp = mesh.pp_size if mesh.pp_size is not None else (2 if pipeline_chosen else 1)
        if pipeline_chosen and pp == 1:
            raise ConfigError("mesh.pp_size=1 with a pipeline schedule: a pipeline needs "
                              "mesh.pp_size >= 2, or choose pipeline=none")
        if not pipeline_chosen and pp > 1:
            raise ConfigError(f"mesh.pp_size={pp} needs a pipeline schedule: add pipeline=1f1b "
                              "(or another file of conf/pipeline/)")
        return cls(dp=mesh.dp_size, dp_replicate=mesh.dp_replicate_size or 1, tp=mesh.tp_size,
                   cp=mesh.cp_size, cp_ulysses=mesh.cp_ulysses_size or 1, pp=pp,
                   ep=mesh.ep_size)

    @property
    def model_parallel(self) -> int:
        """tp x cp x pp: the world size must be a multiple of it."""
        return self.tp * self.cp * self.pp

    @property
    def product(self) -> str:
        return f"{self.tp}*{self.cp}*{self.pp}"

    def layout(self, world: int, source: str, note: str = "") -> Layout:
        """The layout on ``world`` ranks. ``source``: where that number comes from, for the
        messages; ``note``: said when HSDP's replication does not divide dp."""
        non_dp = self.model_parallel
        if world % non_dp:
            raise ConfigError(f"{source} is not divisible by mesh.tp_size * mesh.cp_size * "
                              f"mesh.pp_size = {self.product} = {non_dp}")
        dp = world // non_dp
        if self.dp is not None and self.dp != dp:
            raise ConfigError(
                f"mesh sizes multiply to mesh.dp_size*tp*cp*pp = {self.dp}*{self.product} = "
                f"{self.dp * non_dp}, but {source}; set mesh.dp_size={dp} or null (inferred), "
                "or change the process count")
        replicate = self.dp_replicate
        if dp % replicate:
            raise ConfigError(f"mesh.dp_replicate_size={replicate} must divide the data-parallel "
                              f"size dp={dp}" + (f" ({note})" if note else ""))
        if self.cp % self.cp_ulysses:
            raise ConfigError(f"mesh.cp_ulysses_size={self.cp_ulysses} must divide "
                              f"mesh.cp_size={self.cp} (cp = ring x ulysses)")
        if (dp * self.cp * self.tp) % self.ep:
            raise ConfigError(f"mesh.ep_size={self.ep} must divide dp*cp*tp = "
                              f"{dp * self.cp * self.tp} (experts are folded over those ranks)")
        return Layout(pp=self.pp, dp_replicate=replicate, dp_shard=dp // replicate, cp=self.cp,
                      cp_ulysses=self.cp_ulysses, tp=self.tp, ep=self.ep)
