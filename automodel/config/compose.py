"""Compose a config as the CLI does (``conf/train.yaml`` and its groups, with overrides) and
resolve it: what every entry point and the searches start from."""

from __future__ import annotations

import os
from pathlib import Path

from automodel.config.launch_env import detect_launch_env

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


def resolve_hydra_job(cfg, hc, output_dir: str, multirun: bool, env=None):
    """The ``TrainConfig`` of a job Hydra composed (``hc``: its ``hydra`` node); also used by
    the SLURM launcher at submit time, before the job exists."""
    from automodel.config.resolve import resolve

    return resolve(cfg, env=env, output_dir=output_dir, choices=dict(hc.runtime.choices),
                   overrides=list(hc.overrides.task),
                   sweep_dir=str(hc.sweep.dir) if multirun else None,
                   output_named_by_time=named_by_time(hc, multirun, env))


def named_by_time(hc, multirun: bool, env=None) -> bool:
    """Whether the job's output directory is new for every submission: Hydra names it by the
    time (``${now:...}`` in ``hydra.run.dir`` or ``hydra.sweep.dir``)."""
    from omegaconf import OmegaConf

    launch = detect_launch_env(os.environ if env is None else env)
    injected = launch.external and launch.rank != 0 and not multirun
    if injected and "hydra.run.dir=." in hc.overrides.hydra:  # (prepare_argv's, on ranks
        # other than 0: rank 0 keeps the user's directory, or the default one, named by time)
        return sum(o.startswith("hydra.run.dir=") for o in hc.overrides.hydra) < 2
    template = OmegaConf.to_container(hc.sweep if multirun else hc.run, resolve=False)["dir"]
    return "${now:" in str(template)
