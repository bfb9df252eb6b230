"""DistributedSetup: the one object the runner consults about parallelism."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from automodel.config.layout import Layout
from automodel.config.policies import PolicySpec
from automodel.config.strategies import Strategy
from automodel.config.strategies import strategy as strategy_of
from automodel.distributed.context_parallel import ContextParallel
from automodel.distributed.init import DistInfo
from automodel.distributed.mesh import MeshAxis, MeshContext


@dataclass
class DistributedSetup:
    strategy: Strategy  # an entry of config/strategies.STRATEGIES (a name is looked up)
    options: Any  # the strategy's option dataclass
    dist: DistInfo
    mesh: Optional[MeshContext]  # None for a single process without a group
    activation_checkpointing: str = "none"  # none | full | selective
    activation_checkpointing_scope: list = field(default_factory=lambda: ["all"])
    mp_policy: Optional[PolicySpec] = None
    offload_policy: Optional[PolicySpec] = None
    pipeline: Any = None  # PipelineConfig when pp is on
    pre_shard_hook: Optional[Callable[[nn.Module], None]] = None
    cp: Optional[ContextParallel] = None  # the sequence is split over cp ranks
    loss: str = "auto"  # trainer.loss: auto | fused | plain (the LM head joins the loss)
    loss_chunk_tokens: int = 1024

    def __post_init__(self):
        # a name becomes its entry; an unknown one is refused here, with the allowed names
        self.strategy = strategy_of(self.strategy)

    @property
    def layout(self) -> Layout:
        """The degrees the mesh was built from (one rank's without a mesh)."""
        return Layout() if self.mesh is None else self.mesh.layout

    @property
    def ep_enabled(self) -> bool:
        return self.layout.ep_enabled

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def size(self, axis: MeshAxis) -> int:
        return 1 if self.mesh is None else self.mesh.size(axis)

    @property
    def dp_size(self) -> int:
        return self.size(MeshAxis.DP)

    @property
    def dp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.dp_rank

    @property
    def pp_enabled(self) -> bool:
        return self.layout.pp_enabled

    @property
    def process_group(self):
        """The model-local group (the mesh's ranks, and no other): every collective the recipe
        issues itself (the per-step read, barriers, checkpoints) runs on it, so other ranks of
        the job may hold another model. None without a process group."""
        return None if self.mesh is None else self.mesh.group

    @property
    def loss_group(self):
        """Ranks holding different tokens of the global batch (data-parallel x context-
        parallel): losses and token counts are summed over them (None = no group)."""
        return None if self.mesh is None else self.mesh[MeshAxis.DP_CP].get_group()

    @property
    def grad_average_size(self) -> int:
        """The number of ranks DDP/FSDP2 average gradients over (dp x cp); a micro-batch
        loss is scaled by it so the averaged gradient is the global token mean's.
        A strategy may reduce otherwise (``GradSync.average_size``: Megatron-FSDP sums under
        ``calculate_per_token_loss``)."""
        if self.strategy.grad_sync.average_size is not None:
            return self.strategy.hook("average_size")(self)
        return self.size(MeshAxis.DP_CP)

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        name = getattr(self.options, "autocast_dtype", None)
        return None if name is None else getattr(torch, name)


def named_hook(path: Optional[str]) -> Optional[Callable[[nn.Module], None]]:
    """``parallelism.pre_shard_hook``: the user's function, whose failures name it."""
    if path is None:
        return None
    from automodel.imports import load_object

    hook = load_object(path, "parallelism.pre_shard_hook")

    def call(part: nn.Module) -> None:
        try:
            hook(part)
        except Exception as err:
            raise RuntimeError(f"parallelism.pre_shard_hook={path} failed on "
                               f"{type(part).__name__}: {type(err).__name__}: {err}") from err

    return call
