"""Simulating a deep model from two shallow copies of it.

A rank's simulation costs time in proportion to the decoder layers it runs (times its
micro-batches). The layers of most models are alike, and what a rank holds and does grows by the
same amount with each layer it holds: its parameters, gradients and optimizer states, the
activations its in-flight micro-batches keep, its FLOPs and its per-layer collectives. So a
rank class is simulated with the model cut to ``SHALLOW`` layers per pipeline stage, twice, and
every number of the simulation is extended along the line through the two to the rank's real
layer count. Used where that saves much (``MIN_LAYERS`` per stage or more) and the layers are
alike (the same parameter shapes, no per-layer pattern in the config); otherwise, and with
``plan.full_depth=true``, the whole model is simulated.

The two depths must both be past the model's edge effects: FSDP2 keeps a few layers' buffers in
flight around the one it runs (the next layer's prefetched parameters, the previous one's
gradient reduction), so a rank's peak grows faster than a layer's own cost until it holds
about four layers. With 2 and 3 layers the line was that much too steep: the plan of a 70B
model with two sequences per micro-batch came out at 82.8 GiB instead of 22.2. ``SHALLOW`` starts
at 4, where the peak of every layout tried grows by exactly one layer's cost
(``tests/planning/test_depth.py`` checks such a layout against the whole model).

Under a pipeline FSDP2 gathers each layer once a step and keeps it gathered through the
schedule (``reshard_after_forward`` false, its default there): nothing is in flight around a
layer, and from 1 and 2 layers per stage every number of the dense layouts tried equals the
whole model's (1F1B, interleaved with tp 2 or with full AC; the 70B plan of 512 ranks, pp 4
interleaved: in 37 s instead of 60 with 2 and 3 layers, less again with 1 and 2). So such a job
takes ``SHALLOW_GATHERED`` from ``MIN_LAYERS_GATHERED`` layers per stage. With
``reshard_after_forward=true`` the edge returns (2 and 3 layers: 1% off), and the default pair
is taken. (Mixtures of experts under a pipeline are within 1% of the whole model's peak with
either pair; their layers' cost is not quite a line.)
"""

from __future__ import annotations

import dataclasses

from automodel.config.pipeline_layout import stage_layer_ranges
from automodel.config.resolve import TrainConfig

SHALLOW = (4, 5)  # layers per stage of the two shallow simulations
MIN_LAYERS = 12  # per stage: below this the whole model is simulated (no time saved)
SHALLOW_GATHERED = (1, 2)  # ... where FSDP2 keeps the pipeline's layers gathered all step
MIN_LAYERS_GATHERED = 8
# config keys that make layers differ (dense layers before MoE ones, attention patterns)
PER_LAYER_KEYS = ("first_k_dense_replace", "mlp_only_layers", "layer_types",
                   "decoder_sparse_step", "moe_layer_freq", "sliding_window_pattern")


def stage_count(cfg: TrainConfig) -> int:
    if cfg.pipeline is None:
        return 1
    from automodel.distributed.pipelining.schedule import stage_layout

    return stage_layout(cfg.pipeline, cfg.layout.pp, _layers(cfg))[0]


def _layers(cfg: TrainConfig) -> int:
    from automodel.models import multimodal as mm
    from automodel.models.builder import hf_config

    return mm.text_config(hf_config(cfg.model)).num_hidden_layers


def shallow_pair(cfg: TrainConfig) -> tuple[tuple[int, int], int]:
    """(the two depths per stage, the fewest layers per stage that use them) of ``cfg``."""
    from automodel.config.schema import FSDP2Config

    par = cfg.parallelism
    gathered = cfg.pipeline is not None and isinstance(par, FSDP2Config) \
        and par.reshard_after_forward is not True and par.moe.reshard_after_forward is not True
    return (SHALLOW_GATHERED, MIN_LAYERS_GATHERED) if gathered else (SHALLOW, MIN_LAYERS)


def shallow_depths(cfg: TrainConfig) -> tuple[int, list[int], tuple[int, int]] | None:
    """(stage count, layers of each stage, the two depths per stage) where the shortcut
    applies, else None."""
    from automodel.models import multimodal as mm
    from automodel.models.builder import hf_config

    p = cfg.pipeline
    if p is not None and (p.layers_per_stage or p.module_fqns_per_model_part
                          or p.pp_schedule_csv):
        return None  # (stages the user placed: simulated as they are)
    text = mm.text_config(hf_config(cfg.model))
    if mm.is_image_text(hf_config(cfg.model)) or layers_differ(text):
        return None
    stages = stage_count(cfg)
    sizes = [len(r) for r in stage_layer_ranges(text.num_hidden_layers, stages)]
    pair, least = shallow_pair(cfg)
    return (stages, sizes, pair) if min(sizes) >= least else None


def layers_differ(text) -> bool:
    """Whether the (text) config makes its decoder layers differ (``PER_LAYER_KEYS``)."""
    return any(getattr(text, k, None) not in (None, 1, [], 0) and not _uniform(getattr(text, k))
               for k in PER_LAYER_KEYS)


def _uniform(value) -> bool:
    return isinstance(value, (list, tuple)) and len(set(value)) <= 1


def shallow_config(cfg: TrainConfig, per_stage: int, stages: int) -> TrainConfig:
    """``cfg`` with the model cut to ``per_stage`` layers in each of ``stages`` stages."""
    model = dataclasses.replace(cfg.model, config={**cfg.model.config,
                                                   "num_hidden_layers": per_stage * stages})
    return dataclasses.replace(cfg, model=model)


def extend(a: dict, b: dict, layers_a: int, layers_b: int, layers: int) -> dict:
    """The simulation ``a`` (with ``layers_a`` layers on the rank) extended along the line
    through ``b`` (``layers_b``) to ``layers``: every number; the rest is ``a``'s."""
    def along(x, y):
        return x + (y - x) * (layers - layers_a) / (layers_b - layers_a)

    return {k: combine(along, v, b.get(k, v)) for k, v in a.items()}


def combine(fn, first, *rest):
    """``fn`` over the numbers at the same place of alike simulations (nested dicts; a number
    missing from one is 0); anything else is ``first``'s. Integers stay integers."""
    if isinstance(first, dict) or any(isinstance(r, dict) for r in rest):
        parts = [first or {}, *(r or {} for r in rest)]
        return {k: combine(fn, *(d.get(k, 0) for d in parts)) for k in set().union(*parts)}
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    value = fn(first, *rest)
    return round(value) if all(isinstance(x, int) for x in (first, *rest)) else value
