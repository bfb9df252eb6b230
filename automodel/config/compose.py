"""Compose a config as the CLI does (``conf/train.yaml`` and its groups, with overrides) and
resolve it: what every entry point and the searches start from."""

from __future__ import annotations

import os
from pathlib import Path

CONF_DIR = os.environ.get("AUTOMODEL_CONF_DIR",
                          str(Path(__file__).resolve().parents[2] / "conf"))


def compose(overrides: list[str] | None = None):
    """The composed DictConfig for these overrides (``conf/train.yaml`` + groups)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from automodel.config.cli_check import check_choice_overrides
    from automodel.config.store import register_schemas

    register_schemas()
    check_choice_overrides(list(overrides or []))
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app (plan.py): its conf/
        return hydra_compose(config_name="train", overrides=list(overrides or []),
                             return_hydra_config=True)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides or []),
                             return_hydra_config=True)


def load_config(overrides: list[str] | None = None, output_dir: str = ".", env=None):
    """Compose and resolve: a validated ``TrainConfig`` (raises ``ConfigError``)."""
    from omegaconf import OmegaConf

    from automodel.config.resolve import resolve

    cfg = compose(overrides)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    return resolve(cfg, env=env, output_dir=output_dir, choices=choices, overrides=overrides)
