"""Glue between ``train.py`` (Hydra) and automodel. No torch at import time."""

from __future__ import annotations

import os
import sys

from automodel.config.build import ConfigError
from automodel.launch.env import detect_launch_env


def _fail(kind: str, message: str, code: int):
    print(f"automodel: {kind}:\n{message}", file=sys.stderr, flush=True)
    sys.exit(code)


def prepare_argv() -> None:
    """Adjust ``sys.argv`` before Hydra parses it.

    - Under torchrun every rank runs train.py and composes its own config; only rank 0 keeps
      a Hydra output directory and log file (the others learn rank 0's directory later).
    - Unknown keys get a message listing what is allowed.
    """
    launch = detect_launch_env(os.environ)
    if launch.external and launch.rank != 0:
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.",
                     "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    from automodel.config.cli_check import check_cli_overrides

    try:
        check_cli_overrides(sys.argv[1:])
    except ConfigError as err:
        _fail("configuration error", str(err), 2)


def run_from_hydra(cfg):
    """The Hydra task: validate, then run the job on one or more ranks."""
    from hydra.core.hydra_config import HydraConfig

    from automodel.config.resolve import resolve
    from automodel.launch.support import check_runtime_support

    hc = HydraConfig.get()
    try:
        train_cfg = resolve(cfg, output_dir=hc.runtime.output_dir,
                            choices=dict(hc.runtime.choices), overrides=list(hc.overrides.task))
        check_runtime_support(train_cfg)
    except ConfigError as err:
        _fail("configuration error", str(err), 2)

    from automodel.launch.local import LaunchError, launch

    try:
        records = launch(train_cfg)
    except LaunchError as err:
        _fail("job failed", str(err), 1)
    return records[-1]["loss"] if records else None
