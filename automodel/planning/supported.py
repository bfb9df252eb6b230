"""What the planner cannot simulate, refused before any simulation starts (``ConfigError``
naming the key, the value and the fix): strategies (``planning/strategies.py`` holds that
rule) and model families whose forward reads token values on the host."""

from __future__ import annotations

from automodel.config.build import ConfigError
from automodel.config.resolve import TrainConfig

# a method of the model's that computes positions from the token values (Qwen2-VL's
# multi-axis rotary positions: where the image tokens are, and each image's grid)
VALUE_POSITIONS = "get_rope_index"


def check_plannable(cfg: TrainConfig, model=None) -> None:
    """Raise ``ConfigError`` if ``cfg``'s job cannot be simulated. ``model``: its meta model
    when already built."""
    from automodel.planning.strategies import planning_strategy

    planning_strategy(cfg.strategy)
    if model is None:
        from automodel.models.builder import build_meta_model

        model = build_meta_model(cfg.model)
    reads = [type(m).__name__ for m in model.modules()
             if callable(getattr(m, VALUE_POSITIONS, None))]
    if reads:
        raise ConfigError(
            f"model={cfg.model.name} ({reads[0]}, model_type "
            f"{getattr(model.config, 'model_type', '?')}) cannot be planned: its forward "
            f"computes the vision position ids from the token values ({VALUE_POSITIONS}: "
            "where the image tokens are and each image's grid), which the planner's fake "
            "tensors do not have; plan its language model alone (the same text config as a "
            "causal LM) or an image-text model with plain positions (e.g. model=llava_tiny "
            "shapes), and measure this one with a short run")
