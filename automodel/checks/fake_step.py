"""The preflight's fake step: one training step of each pipeline rank of the job, run in this
process on fake tensors before any process group starts, so that a layout that would crash
in its first step is refused before launch, naming the family, the layout and the module.

It is the planner's simulation of a rank (``planning/simulate.py``: a fake process group of
the job's size, automodel's own mesh, ``parallelize``, optimizer and step; no byte of the
model allocated), cut down to a shape check:

- the model cut to one decoder layer per pipeline stage, two at least where its layers
  differ (config keys that describe layers by index are cut to match, keeping each kind of
  layer where there is room); stages the user placed by name keep the whole model; an
  image-text model's vision tower cut to two layers, or to the deepest one it reads;
- one local batch of the job's shapes per rank (no gradient accumulation; under a pipeline,
  as many micro-batches of the job's size as its schedule needs at least);
- one rank per kind of pipeline rank (the ranks of a stage hold equal shares, and ranks
  holding only middle stages, as many, take the same shapes);
- nothing measured, and at most ``TIME_BOUND_SECONDS``: a step still running then is cut
  short with a warning, and the job starts unchecked.

Layouts without tensor, context, pipeline or expert parallelism run the model's own code as
one process does and are not stepped, unless ``parallelism.mp_policy`` casts the parameters
to a lower precision (the default: bfloat16): one process trains in float32, and a family
whose forward mixes its float32 buffers with cast weights (GPT-1's attention mask) fails
only then. ``distributed.preflight_step=false`` turns it off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time

from automodel.checks.step_refusal import casts_parameters, not_the_layout, refusal
from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig

log = logging.getLogger(__name__)

TIME_BOUND_SECONDS = 30.0


class _OutOfTime(BaseException):
    """Raised in the main thread when the bound passes (a BaseException: model code that
    catches Exception must not swallow it)."""


def needs_fake_step(cfg: TrainConfig) -> bool:
    m = cfg.mesh
    return cfg.distributed.preflight_step and (
        max(m.tp_size, m.cp_size, m.ep_size, cfg.layout.pp) > 1 or casts_parameters(cfg))


def check_fake_step(cfg: TrainConfig) -> None:
    """Raise ``ConfigError`` when a rank's first step of ``cfg``'s layout fails on fake
    tensors."""
    if not needs_fake_step(cfg):
        return
    import torch.distributed as dist

    from automodel.planning.strategies import planning_strategy

    if dist.is_initialized():  # (every entry point runs the preflight before its group)
        log.info("preflight: no fake step inside a running process group")
        return
    from automodel.compat import CompatError, check_planning_compat

    try:
        check_planning_compat()  # (the simulation's own uses of torch internals)
    except CompatError as err:
        log.warning("preflight: no fake step: %s", err)
        return
    try:  # (a strategy the planner cannot run on fake tensors: megatron_fsdp, CUDA only)
        planning_strategy(cfg.strategy)
    except ConfigError as err:
        log.info("preflight: no fake step: %s", err)
        return
    from automodel.planning.plan import layout_text
    from automodel.planning.simulate import fake_step

    step_cfg, layers = cut_down(cfg)
    start = time.monotonic()
    classes = distinct_rank_classes(step_cfg)
    try:
        with _time_bound(TIME_BOUND_SECONDS), _quiet():
            for c in classes:
                _step_or_refuse(fake_step, step_cfg, c, layers, layout_text(cfg))
    except _OutOfTime:
        log.warning("preflight: the fake step of %s did not finish within %.0f s and was cut "
                    "short; the job starts without it (distributed.preflight_step=false skips "
                    "it)", layout_text(cfg), TIME_BOUND_SECONDS)
        return
    log.info("preflight: one step of %s on fake tensors (%d rank class%s, %d layer%s) in "
             "%.1f s", layout_text(cfg), len(classes), "es" if len(classes) > 1 else "",
             layers, "s" if layers > 1 else "", time.monotonic() - start)


def distinct_rank_classes(cfg: TrainConfig) -> list:
    """The planner's rank classes (one per pipeline rank), one of each kind: ranks whose
    stages are alike (as many, none first or last) take the same shapes, so the first
    stands for the others."""
    from automodel.planning.plan import rank_classes

    classes = rank_classes(cfg)
    if cfg.pipeline is None:
        return classes
    from automodel.distributed.pipelining.schedule import stage_layout
    from automodel.models import multimodal as mm
    from automodel.models.builder import hf_config

    layers = mm.text_config(hf_config(cfg.model)).num_hidden_layers
    num_stages, by_rank = stage_layout(cfg.pipeline, cfg.layout.pp, layers)
    seen, out = set(), []
    for c, stages in zip(classes, by_rank):
        kind = (len(stages), 0 in stages, num_stages - 1 in stages)
        if kind not in seen:
            seen.add(kind)
            out.append(c)
    return out


def _step_or_refuse(fake_step, cfg: TrainConfig, rank_class, layers: int, layout: str) -> None:
    """Refuse what fails inside the model's forward (a module's, or the causal LM's own):
    shapes and placements the model cannot take. A failure elsewhere (building the stages,
    the schedule, the optimizer on fake tensors) is the simulation's limit, not the job's:
    it is logged, and the job starts unchecked.

    An image-text model's vision tower is cut to a few layers first (``mm.tower_cut``: its
    layers repeat, and a 24-layer tower took the step past its time bound); where the cut
    tower fails otherwise than by reading tensor values, which the whole one would read too,
    the step runs again with the whole tower, and that outcome counts."""
    from automodel.models import multimodal as mm
    from automodel.models.builder import hf_config

    cut = mm.tower_cut(hf_config(cfg.model))
    if cut is not None:
        shallow = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, config={**cfg.model.config, **cut}))
        failure = _try_step(fake_step, shallow, rank_class)
        if failure is None or _reads_values(failure):
            return _judge(failure, layout, rank_class, layers, cfg)
        log.info("preflight: the fake step with the vision tower cut to %d layers fails "
                 "(%s: %s); stepping the whole tower", cut["vision_config"]["num_hidden_layers"],
                 type(failure).__name__, str(failure).strip()[:300])
    _judge(_try_step(fake_step, cfg, rank_class), layout, rank_class, layers, cfg)


def _try_step(fake_step, cfg: TrainConfig, rank_class) -> Exception | None:
    """Run the rank's fake step; its failure, or None (a ``ConfigError`` is raised)."""
    try:
        fake_step(cfg, rank_class.rank)
    except ConfigError:
        raise
    except Exception as err:
        return err
    return None


def _reads_values(failure: Exception) -> bool:
    from automodel.compat.planning import needs_values
    from automodel.planning.fake import ModuleFailed

    return isinstance(failure, ModuleFailed) and needs_values(_root_cause(failure.error))


def _judge(failure: Exception | None, layout: str, rank_class, layers: int,
           cfg: TrainConfig) -> None:
    """Refuse a failure in the model's forward, log any other (see ``_step_or_refuse``)."""
    from automodel.planning.fake import ModuleFailed

    if failure is None:
        return
    if _reads_values(failure):  # (fake tensors have no values: the simulation's limit)
        log.warning("preflight: the fake step of %s cannot run %s: %s reads tensor values "
                    "(%s); the job starts without this check", layout, rank_class.name,
                    failure.module, type(_root_cause(failure.error)).__name__)
    elif isinstance(failure, ModuleFailed):
        err = _root_cause(failure.error)
        if _fails_alone(cfg):
            raise ConfigError(not_the_layout(cfg, layers, failure.module, err)) from None
        raise ConfigError(refusal(cfg, layout, rank_class, layers, failure.module,
                                  err)) from None
    else:
        log.warning("preflight: the fake step of %s could not run %s outside the model's "
                    "forward (%s: %s); the job starts without this check", layout,
                    rank_class.name, type(failure).__name__, str(failure).strip()[:300])


def _root_cause(err: BaseException) -> BaseException:
    """The innermost of a chain of errors (the pipeline's stage wraps the model's)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _fails_alone(cfg: TrainConfig) -> bool:
    """Whether the step also fails in one process without parallelism (same model, options
    and batch shapes); False where that step cannot be run here."""
    from automodel.checks.step_refusal import one_process
    from automodel.planning.fake import ModuleFailed
    from automodel.planning.plan import rank_classes
    from automodel.planning.simulate import fake_step

    try:
        alone = one_process(cfg)
    except Exception:  # (a configuration one process cannot hold)
        return False
    failure = _try_step(fake_step, alone, rank_classes(alone)[0])
    return isinstance(failure, ModuleFailed) and not _reads_values(failure)


def cut_down(cfg: TrainConfig) -> tuple[TrainConfig, int]:
    """(``cfg`` with the model cut to one layer per pipeline stage, two at least where its
    layers differ, and one local batch per rank; its layer count). Stages placed by name
    (``module_fqns_per_model_part``, a CSV schedule) keep every layer."""
    from automodel.models import multimodal as mm
    from automodel.models.builder import hf_config
    from automodel.planning.depth import layers_differ, stage_count

    p = cfg.pipeline
    text = mm.text_config(hf_config(cfg.model))
    total = text.num_hidden_layers
    layers = total
    if p is None or (p.module_fqns_per_model_part is None and p.pp_schedule_csv is None):
        layers = min(total, max(stage_count(cfg), 2 if layers_differ(text) else 1))
    changes = {}
    if layers < total:
        cut = mm.text_overrides(hf_config(cfg.model), {**_per_layer_keys(text, layers),
                                                       "num_hidden_layers": layers})
        changes["model"] = dataclasses.replace(cfg.model, config={**cfg.model.config, **cut})
        try:
            hf_config(changes["model"])
        except Exception as err:  # (a family whose other keys count layers: Dory's sections)
            log.info("preflight: the fake step runs all %d layers: transformers refuses the "
                     "model cut to %d (%s)", total, layers, _root_cause(err))
            return dataclasses.replace(cfg, **_one_batch(cfg, p)), total
        if p is not None and p.layers_per_stage is not None:
            changes["pipeline"] = dataclasses.replace(p, layers_per_stage=1)
    changes.update(_one_batch(cfg, changes.get("pipeline", p)))
    return dataclasses.replace(cfg, **changes), layers


def _one_batch(cfg: TrainConfig, p) -> dict:
    """One local batch per rank, no gradient accumulation; under a pipeline the fewest
    micro-batches its schedule takes (a CSV schedule keeps the job's)."""
    t, dp = cfg.trainer, cfg.layout.dp
    if p is None:
        return {"trainer": dataclasses.replace(t, global_batch_size=dp * t.local_batch_size)}
    if p.pp_schedule_csv is not None:
        return {}
    from automodel.config.pipeline_layout import canonical_schedule

    pp = cfg.layout.pp
    per_rank = p.pp_microbatch_size * pp * (2 if canonical_schedule(p.pp_schedule) ==
                                            "dualpipev" else 1)
    return {"trainer": dataclasses.replace(t, global_batch_size=dp * per_rank,
                                           local_batch_size=per_rank),
            "pipeline": dataclasses.replace(p, pp_batch_size=None)}


def _per_layer_keys(text, layers: int) -> dict:
    """Config keys that describe layers by index, for the first ``layers`` layers, keeping
    each kind of layer where there is room: lists of one value per layer (``layer_types``)
    take the first layer of each kind, then the next ones; a count of leading dense layers
    (``first_k_dense_replace``) leaves at least one layer of the other kind."""
    out: dict = {}
    for key, value in vars(text).items():
        if isinstance(value, (list, tuple)) and len(value) == text.num_hidden_layers:
            first = sorted({value.index(v) for v in value})
            rest = [i for i in range(len(value)) if i not in first]
            out[key] = [value[i] for i in sorted((first + rest)[:layers])]
    k = getattr(text, "first_k_dense_replace", None)
    if isinstance(k, int) and k >= layers:
        out["first_k_dense_replace"] = layers - 1
    return out


@contextlib.contextmanager
def _quiet():
    """Without torch's own reports of what the step does on fake tensors: the fake mode's
    log of a failing op (the refusal says it), DTensor's advice on redistributions (the
    planner's concern), warnings of the model's forward."""
    import warnings

    loggers = [logging.getLogger(name) for name in ("torch._subclasses.fake_tensor",
                                                    "torch.distributed.tensor._redistribute")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# modules whose code holds locks a raise in its midst could leave held (logging's module
# lock: every later log call of the process would wait for it forever)
_NO_RAISE_IN = ("logging", "threading", "importlib", "warnings", "queue", "weakref")
# nor while the fake world's default process group is made or destroyed (a raise there would
# leave a group behind in this process, and the next preflight would find it)
_NO_RAISE_IN_MODULES = ("torch.distributed.distributed_c10d",)


def _inside_lock_holders(frame) -> bool:
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] in _NO_RAISE_IN or name in _NO_RAISE_IN_MODULES:
            return True
        frame = frame.f_back
    return False


def _expire(signum, frame):
    """SIGALRM: end the step, unless the main thread is inside code that holds a lock (then
    again in 20 ms)."""
    if _inside_lock_holders(frame):
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        return
    raise _OutOfTime()


@contextlib.contextmanager
def _time_bound(seconds: float):
    """Raise ``_OutOfTime`` in the main thread after ``seconds`` (SIGALRM), at a point outside
    the standard library's lock-holding code; elsewhere, no bound."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
