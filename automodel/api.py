"""Python entry points: compose a config as the CLI would, resolve it, run it."""

from __future__ import annotations

from automodel.config.compose import CONF_DIR, compose, load_config  # noqa: F401 (the API)


def run(overrides: list[str] | None = None, output_dir: str = "."):
    """Train as ``python train.py <overrides>`` would; returns rank 0's metric records."""
    from automodel.checks.preflight import preflight
    from automodel.launch.local import launch
    from automodel.prepare.plan_first import ensure_plan

    cfg = load_config(overrides, output_dir)
    if cfg.layout_mode == "auto":
        from automodel.config.build import ConfigError

        raise ConfigError("layout=auto: automodel.api.run trains the layout it is given; "
                          "launch with python train.py layout=auto (which searches first)")
    ensure_plan(cfg)  # (trainer.plan_check_steps: the plan, before any rank starts)
    preflight(cfg)
    return launch(cfg)
