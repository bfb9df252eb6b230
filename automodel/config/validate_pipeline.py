"""Validation rules of the pipeline section (no torch): schedule names, stages against the
model's layers, micro-batches, CSV schedules. ``resolve.py`` calls them."""

from __future__ import annotations

import logging
import os

from automodel.config import schema as s
from automodel.config.build import ConfigError
from automodel.config.layout import Layout
from automodel.config.pipeline_layout import (
    SCHEDULE_SHAPES,
    canonical_schedule,
    count_stages,
)
from automodel.config.validate_model import model_numbers
from automodel.config.value_checks import check_dtype, positive

log = logging.getLogger(__name__)


def check_pipeline_model(p: s.PipelineConfig, mesh: s.MeshConfig, model: s.ModelConfig,
                         trainer: s.TrainerConfig, layers: int | None = None) -> None:
    """Stages against the model's layers and the micro-batches. ``layers``: the model's layer
    count when known from the model itself (else read from its config)."""
    if layers is None:
        layers = model_numbers(model).get("num_hidden_layers")
    pp = mesh.pp_size
    if p.pp_schedule_csv is not None:
        from automodel.config.pipeline_csv import read_csv_layout

        name, stages = "csv", read_csv_layout(p.pp_schedule_csv).num_stages
    else:
        name = canonical_schedule(p.pp_schedule)
        multi, v_shape = SCHEDULE_SHAPES[name]
        if p.module_fqns_per_model_part is not None:
            stages = len(p.module_fqns_per_model_part)
            need = (f"{pp} (one per rank)" if not multi else f"{2 * pp} (two per rank, V)"
                    if v_shape else f"a multiple of {pp}, at least {2 * pp}")
            if (not multi and stages != pp) or (v_shape and stages != 2 * pp) or (
                    multi and not v_shape and (stages % pp or stages < 2 * pp)):
                raise ConfigError(f"pipeline.module_fqns_per_model_part has {stages} parts; "
                                  f"pipeline.pp_schedule={p.pp_schedule} with mesh.pp_size={pp} "
                                  f"needs {need}")
        elif isinstance(layers, int):
            try:
                stages = count_stages(layers, pp, multi, v_shape, p.layers_per_stage,
                                      p.round_virtual_stages_to_pp_multiple)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            if not multi and p.layers_per_stage is not None and p.layers_per_stage * pp != layers:
                raise ConfigError(f"pipeline.layers_per_stage={p.layers_per_stage} x mesh.pp_size="
                                  f"{pp} stages != the model's {layers} layers "
                                  f"({p.pp_schedule} has one stage per rank)")
        else:
            stages = None
    if isinstance(layers, int) and stages is not None and stages > layers:
        raise ConfigError(f"pipeline.pp_schedule={p.pp_schedule} with mesh.pp_size={pp} needs "
                          f"{stages} stages but the model has model.config.num_hidden_layers="
                          f"{layers} (at least one layer per stage)")
    m = Layout.of(mesh).pipeline_microbatches(trainer.global_batch_size, p.pp_batch_size,
                                              p.pp_microbatch_size)
    if name == "1f1b" and m < pp:
        raise ConfigError(f"1f1b needs at least mesh.pp_size={pp} micro-batches, got {m} "
                          "(pipeline.pp_batch_size / pipeline.pp_microbatch_size)")
    if name == "dualpipev" and m < 2 * pp:
        raise ConfigError(f"DualPipeV needs at least {2 * pp} micro-batches (its stage count), "
                          f"got {m}")
    rounds = max(1, m // pp)
    if name in ("interleaved_1f1b", "dfs", "zero_bubble") and m % rounds:
        raise ConfigError(f"{p.pp_schedule} needs the micro-batch count ({m}) to be a multiple of "
                          f"its rounds (micro-batches // pp = {rounds}); use a multiple of "
                          f"mesh.pp_size={pp}")
    if stages is not None and m < stages:
        log.warning("pipeline: %d micro-batches for %d stages leaves most ranks idle (a large "
                    "bubble); use at least %d (pipeline.pp_microbatch_size smaller)", m, stages,
                    stages)


def check_pipeline(p: s.PipelineConfig, mesh: s.MeshConfig, trainer: s.TrainerConfig,
                   par) -> None:
    if p.pp_schedule_csv is None and p.pp_schedule == "csv":
        raise ConfigError("pipeline=csv needs the schedule file: "
                          "pipeline.pp_schedule_csv=/path/to/schedule.csv")
    if p.pp_schedule_csv is None:
        try:
            canonical_schedule(p.pp_schedule)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    elif not os.path.isfile(p.pp_schedule_csv):
        raise ConfigError(f"pipeline.pp_schedule_csv={p.pp_schedule_csv!r}: no such file")
    positive("pipeline.pp_microbatch_size", p.pp_microbatch_size)
    positive("pipeline.pp_batch_size", p.pp_batch_size)
    positive("pipeline.layers_per_stage", p.layers_per_stage)
    positive("pipeline.pp_seq_len", p.pp_seq_len)
    if p.pp_seq_len is not None and p.pp_seq_len != trainer.seq_len:
        raise ConfigError(f"pipeline.pp_seq_len={p.pp_seq_len} must equal trainer.seq_len="
                          f"{trainer.seq_len} (every batch has that length), or be null")
    if p.pp_seq_len is not None and getattr(par, "autocast_dtype", None) is not None:
        raise ConfigError("pipeline.pp_seq_len (static stage shapes) with "
                          "parallelism.autocast_dtype: activation dtypes vary under autocast; "
                          "set pipeline.pp_seq_len=null to infer shapes at run time")
    if p.loss_fn is not None and ("." not in p.loss_fn or p.loss_fn.endswith(".")):
        raise ConfigError(f"pipeline.loss_fn={p.loss_fn!r}: an import path looks like "
                          "'package.module.function' (returning the loss summed over tokens)")
    positive("pipeline.pp_recv_buffer_pool_slack", p.pp_recv_buffer_pool_slack, 0)
    check_dtype("pipeline.dtype", p.dtype)
    if p.round_virtual_stages_to_pp_multiple not in (None, "up", "down"):
        raise ConfigError(f"pipeline.round_virtual_stages_to_pp_multiple="
                          f"{p.round_virtual_stages_to_pp_multiple!r}: allowed: up, down, null")
    layout = Layout.of(mesh)
    per_rank = layout.per_rank_batch(trainer.global_batch_size)
    if p.pp_batch_size is not None and per_rank % p.pp_batch_size:
        raise ConfigError(f"pipeline.pp_batch_size={p.pp_batch_size} must divide the per-rank "
                          f"batch trainer.global_batch_size / dp = {per_rank}")
    batch = layout.pipeline_batch(trainer.global_batch_size, p.pp_batch_size)
    if batch % p.pp_microbatch_size:
        raise ConfigError(f"pipeline batch {batch} (pipeline.pp_batch_size, default "
                          f"trainer.global_batch_size / dp) must be divisible by "
                          f"pipeline.pp_microbatch_size={p.pp_microbatch_size}")
    if p.pp_schedule_csv is not None:
        _check_csv(p, mesh, batch // p.pp_microbatch_size)


def _check_csv(p: s.PipelineConfig, mesh: s.MeshConfig, n_microbatches: int) -> None:
    from automodel.config.pipeline_csv import read_csv_layout

    try:
        layout = read_csv_layout(p.pp_schedule_csv)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if len(layout.stages_by_rank) != mesh.pp_size:
        raise ConfigError(f"pipeline.pp_schedule_csv={p.pp_schedule_csv!r} has "
                          f"{len(layout.stages_by_rank)} rows but mesh.pp_size={mesh.pp_size} "
                          "(one row per pipeline rank)")
    if layout.num_microbatches != n_microbatches:
        raise ConfigError(f"pipeline.pp_schedule_csv={p.pp_schedule_csv!r} schedules "
                          f"{layout.num_microbatches} micro-batches but the pipeline batch makes "
                          f"{n_microbatches} (pipeline.pp_batch_size / pp_microbatch_size)")

