"""The strategies: each ``parallelism=<name>`` is one registered ``Strategy``, the one home of
its name, schema, checks, capabilities and run-time hooks.

A new strategy is a schema (a dataclass; subclass ``CommonOptions`` to get activation
checkpointing, compile, autocast and the pre-shard hook), a ``Strategy`` passed to
``register_strategy`` (in the module that defines the schema, so that every process that
unpickles the config registers it too) and an option file ``parallelism/<name>.yaml`` whose
defaults list names the schema (``- /schema/parallelism@_here_: <name>``), in ``conf/`` or in a
directory on Hydra's search path (``hydra.searchpath=[file:///my/conf]``).
``tests/distributed/toy_strategy.py`` is one.

Every strategy declares how its gradients become one over the data-parallel ranks
(``GradSync``): a strategy that forgot cannot be registered, so none trains with no gradient
sync. Nothing outside this registry compares strategy names: code asks an entry for a
capability (``materialize_after_wrap``, ``tensor_parallel``, ...) or calls its hook.

Torch-free: ``config/`` imports this module (its checks run before any process starts); the
run-time hooks are import paths (or callables), loaded when called
(``parallelize.py``, ``recipes/step.py``, ``checks/support.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Union

from automodel.config import schema as s
from automodel.config import validate_parallelism as v
from automodel.registry import Hook, Registry, load_hook


class Reduce(enum.Enum):
    """Where a strategy makes the data-parallel ranks' gradients one."""

    IN_BACKWARD = "in_backward"  # the wrapped model reduces during backward (DDP, FSDP2)
    IN_FINISH = "in_finish"  # ``GradSync.finish`` reduces after the last micro-batch
    ONE_PROCESS = "one_process"  # nothing to reduce: the strategy runs one process


@dataclass(frozen=True)
class GradSync:
    """How a strategy's gradients are synchronized; hooks are import paths or callables.

    - ``defer(model, setup, is_last)``: entered around each micro-batch's forward and
      backward; returns a context manager (or None) that skips the reduce on all but the last
      micro-batch where the strategy can. None: every micro-batch reduces.
    - ``finish(model, setup)``: after the last micro-batch's backward, before clipping (wait
      for a reduce still running, or run it).
    - ``average_size(setup) -> int``: the number of ranks the reduce averages over (each
      micro-batch loss is scaled by it); None: data-parallel x context-parallel ranks.
    """

    reduce: Reduce
    defer: Optional[Hook] = None
    finish: Optional[Hook] = None
    average_size: Optional[Hook] = None

    def __post_init__(self):
        if not isinstance(self.reduce, Reduce):
            raise TypeError(f"GradSync.reduce={self.reduce!r}: one of "
                            f"{', '.join(f'Reduce.{r.name}' for r in Reduce)}")
        if self.reduce is Reduce.IN_FINISH and self.finish is None:
            raise TypeError("GradSync(Reduce.IN_FINISH) needs the finish hook that reduces")
        hooks = (self.defer, self.finish, self.average_size)
        if self.reduce is Reduce.ONE_PROCESS and any(h is not None for h in hooks):
            raise TypeError("GradSync(Reduce.ONE_PROCESS) has nothing to reduce: no hooks")


ONE_PROCESS = GradSync(Reduce.ONE_PROCESS)


MEGATRON_ADAPTERS = ("adapters are not wired into Megatron-FSDP's buffers in this version (it "
                     "runs on CUDA only, and cannot be tested here); train adapters with "
                     "parallelism=fsdp2 (or hsdp)")


@dataclass(frozen=True)
class Strategy:
    """One ``parallelism=<name>``.

    Config-time, torch-free (callables): ``check_layout(name, layout)`` refuses the mesh
    degrees it cannot run (default: data parallelism only); ``resolve(options, layout) ->
    options`` a copy with values other options imply; ``check(options, layout) ->
    ResolvedParallelism`` the option values (raises ``ConfigError``; never changes its
    input; default: ``CommonOptions``'s).

    Run time (import paths or callables, loaded when called; ``setup`` is the
    ``DistributedSetup``):

    - ``wrap(part, blocks, setup, experts) -> part``: the data-parallel wrap of one model
      part (after TP, CP, EP, AC and compile). None: the part as it is.
    - ``wrap_optimizer(parts, optimizers, setup) -> parts``: wraps the model together with
      its optimizer, once the optimizer exists (Megatron-FSDP).
    - ``materialize(part, fill, setup)``: allocates and fills a part built on the meta device
      before the wrap (default ``fill([part])``); see ``materialize_after_wrap``.
    - ``ac_blocks(part, blocks) -> blocks``: what activation checkpointing wraps.
    - ``backward_error(err) -> err``: a clearer error for a failed backward.
    - ``refusal(cfg) -> str | None``: why this machine cannot run it (checked before launch).

    Capabilities: ``materialize_after_wrap`` (the wrap shards the meta model and only this
    rank's shards are allocated, after it: FSDP2), ``tensor_parallel`` (its options carry
    ``tp_plan`` and ``sequence_parallel``; mesh.tp_size is checked against the model),
    ``plain_loss_reason`` (why the LM head cannot join the loss; None: it can),
    ``adapters_refusal`` (why ``peft`` adapters cannot train under it; None: they can),
    ``reducer_walks_outputs`` (DDP: its ``find_unused_parameters`` looks for used parameters
    in the outputs).
    """

    name: str
    schema: type
    grad_sync: GradSync
    check: Callable = v.check_common
    check_layout: Callable = v.only_data_parallel
    resolve: Optional[Callable] = None
    wrap: Optional[Hook] = None
    wrap_optimizer: Optional[Hook] = None
    materialize: Optional[Hook] = None
    ac_blocks: Optional[Hook] = None
    backward_error: Optional[Hook] = None
    refusal: Optional[Hook] = None
    materialize_after_wrap: bool = False
    tensor_parallel: bool = False
    plain_loss_reason: Optional[str] = None
    adapters_refusal: Optional[str] = None
    reducer_walks_outputs: bool = False

    def __post_init__(self):
        if not isinstance(self.grad_sync, GradSync):
            raise TypeError(f"strategy {self.name!r}: grad_sync={self.grad_sync!r}; declare how "
                            "its gradients are synchronized with a GradSync (ONE_PROCESS for a "
                            "strategy that runs one process)")
        wraps = self.wrap is not None or self.wrap_optimizer is not None
        if self.grad_sync.reduce is Reduce.IN_BACKWARD and not wraps:
            raise TypeError(f"strategy {self.name!r}: GradSync(Reduce.IN_BACKWARD) needs a wrap "
                            "(or wrap_optimizer) that makes the model reduce in backward")
        if self.one_process and wraps:
            raise TypeError(f"strategy {self.name!r} runs one process (ONE_PROCESS): it has "
                            "nothing to wrap")

    @property
    def one_process(self) -> bool:
        """It runs one process: no process group, no gradient sync."""
        return self.grad_sync.reduce is Reduce.ONE_PROCESS

    def hook(self, which: str) -> Callable:
        """The run-time hook ``which`` (imported now), of the strategy or its ``GradSync``."""
        owner = self.grad_sync if which in ("defer", "finish", "average_size") else self
        return load_hook(getattr(owner, which), f"parallelism={self.name} ({which})")

    def resolved(self, options, layout):
        """``options``, or a copy with the values other options imply."""
        return options if self.resolve is None else self.resolve(options, layout)


STRATEGIES: Registry[Strategy] = Registry("parallelism", "strategy")

_DDP, _FSDP2, _MEGATRON = ("automodel.distributed.ddp.", "automodel.distributed.fsdp2.",
                           "automodel.distributed.megatron_fsdp.")
_FSDP2_ENTRY = dict(
    grad_sync=GradSync(Reduce.IN_BACKWARD, defer=_FSDP2 + "defer_fsdp2_sync"),
    check=v.check_fsdp2, check_layout=v.check_fsdp2_layout, resolve=v.resolve_fsdp2,
    wrap=_FSDP2 + "wrap_fsdp2", materialize_after_wrap=True, tensor_parallel=True)

SHIPPED = (
    # one process, no wrapping: the reference for loss parity
    Strategy("none", s.SingleProcessConfig, ONE_PROCESS),
    # torch DistributedDataParallel over the data-parallel axis
    Strategy("ddp", s.DDPConfig, GradSync(Reduce.IN_BACKWARD, defer=_DDP + "defer_ddp_sync"),
             check=v.check_ddp, wrap=_DDP + "wrap_ddp",
             backward_error=_DDP + "unused_parameter_hint", reducer_walks_outputs=True),
    # FSDP2 (HSDP when mesh.dp_replicate_size > 1)
    Strategy("fsdp2", s.FSDP2Config, **_FSDP2_ENTRY),
    # FSDP2 on a replicate x shard mesh: its option file sets mesh.dp_replicate_size=2
    Strategy("hsdp", s.HSDPConfig, **_FSDP2_ENTRY),
    # the megatron-fsdp package (CUDA): wraps the model with its optimizer
    Strategy("megatron_fsdp", s.MegatronFSDPConfig,
             GradSync(Reduce.IN_BACKWARD, defer=_MEGATRON + "defer_megatron_sync",
                      finish=_MEGATRON + "finish_megatron_sync",
                      average_size=_MEGATRON + "megatron_average_size"),
             check=v.check_megatron, check_layout=v.check_megatron_layout,
             wrap_optimizer=_MEGATRON + "apply_megatron_fsdp",
             materialize="automodel.distributed.megatron_meta_init.materialize_part",
             ac_blocks=_MEGATRON + "checkpointed_mlps", refusal=_MEGATRON + "refusal_for",
             tensor_parallel=True, plain_loss_reason=v.MEGATRON_PLAIN_LOSS,
             adapters_refusal=MEGATRON_ADAPTERS),
)
for _entry in SHIPPED:
    STRATEGIES.register(_entry)


def register_strategy(entry: Strategy) -> Strategy:
    """Make ``parallelism=<entry.name>`` available (its option file must exist too)."""
    return STRATEGIES.register(entry)


def strategy(name: Union[str, Strategy]) -> Strategy:
    """The strategy called ``name`` (an entry is returned as it is); an unknown name is a
    ``ConfigError`` with the allowed names and the closest one."""
    return name if isinstance(name, Strategy) else STRATEGIES.get(name)
