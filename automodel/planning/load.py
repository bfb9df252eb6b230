"""A plan's configuration from overrides, outside ``plan.py``'s Hydra app (tests, scripts):
composed from ``conf/plan.yaml`` and resolved exactly as ``plan.py`` resolves it."""

from __future__ import annotations

from types import SimpleNamespace


def load_plan(overrides: list[str], output_dir: str = "."):
    """(the job's ``TrainConfig``, the ``PlanConfig``) of ``python plan.py <overrides>``;
    raises ``ConfigError`` where plan.py would refuse. Nothing is simulated."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from automodel.config.cli_check import check_choice_overrides
    from automodel.config.compose import CONF_DIR
    from automodel.config.store import register_schemas
    from automodel.planning.cli import resolve_for_plan, split_plan_node

    register_schemas()
    check_choice_overrides(list(overrides))
    if GlobalHydra.instance().is_initialized():
        cfg = compose(config_name="plan", overrides=list(overrides), return_hydra_config=True)
    else:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="plan", overrides=list(overrides),
                          return_hydra_config=True)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    hc = SimpleNamespace(overrides=SimpleNamespace(task=list(overrides)),
                         runtime=SimpleNamespace(choices=choices))
    train_cfg, plan = split_plan_node(cfg)
    return resolve_for_plan(train_cfg, hc, plan, output_dir), plan
