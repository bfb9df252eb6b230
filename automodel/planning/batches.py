"""The host batches a simulated rank trains on: the configured shapes, not the data.

The plan needs shapes only (tokens per micro-batch, the images of an image-text model), so
the job's data source is not read: rows of uniform random tokens (``data=synthetic``) of the
job's sequence length, with generated images for an image-text model, are split into this
rank's micro-batches as the job's own ``BatchPlan`` would split its rows."""

from __future__ import annotations

from automodel.config.resolve import TrainConfig
from automodel.config.schema import SyntheticDataConfig

SIMULATED_STEPS = 2  # the simulation's steps (planning/simulate.py): batches for steps 0, 1


def planning_batches(cfg: TrainConfig, setup):
    """``step -> micro-batches`` of this rank (data-parallel rank ``setup.dp_rank``)."""
    from automodel.data.batches import BatchPlan
    from automodel.data.sources import training_data
    from automodel.models.builder import hf_config
    from automodel.models.multimodal import is_image_text
    from automodel.recipes.pipeline_step import loader_options

    t = cfg.trainer
    data = SyntheticDataConfig(num_sequences=2 * t.global_batch_size,
                               image_every=getattr(cfg.data, "image_every", 1))
    rows, _ = training_data("synthetic", data, t.seq_len, cfg.model)
    plan = BatchPlan(rows, t.global_batch_size, t.seed)
    # made now, outside the fake mode, as host tensors: the steps the simulation runs (an
    # image-text batch reads its row indices on the host, which a fake tensor cannot give)
    options = loader_options(cfg.pipeline, is_image_text(hf_config(cfg.model)),
                             t.local_batch_size)
    made = {step: plan.micro_batches(step, setup.dp_rank, setup.dp_size, **options)
            for step in range(SIMULATED_STEPS)}
    return made.__getitem__
