"""Where a run's checkpoints go, so that ``checkpoint.resume=auto`` finds them again.

A Hydra output directory is new for every submission (``hydra.run.dir`` is named by the
time), so checkpoints kept in it are not found by the next submission of the same command.
``experiment=NAME`` gives them a directory that every submission of the experiment shares:
``outputs/NAME/checkpoints``, under the directory the job is started from (where the default
output directories go too); each job of a sweep gets its own, ``outputs/NAME/<job>/checkpoints``.
``checkpoint.dir`` set explicitly wins. ``resume=auto`` with neither, in a directory named by the
time, would always start at step 0: it is refused before launch.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from automodel.config.build import ConfigError
from automodel.config.schema import CheckpointConfig

OUTPUTS_ROOT = "outputs"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_experiment(name: Optional[str]) -> None:
    if name is not None and not _NAME.match(str(name)):
        raise ConfigError(f"experiment={name!r}: use a plain name (letters, digits, '.', '_', "
                          "'-'; no '/'): it names the folder outputs/<experiment>")


def experiment_checkpoint_dir(experiment: str, output_dir: str,
                              sweep_dir: Optional[str]) -> str:
    """``outputs/<experiment>[/<sweep job>]/checkpoints``, absolute (from the current
    directory: the one the job is started from)."""
    parts = [OUTPUTS_ROOT, experiment]
    if sweep_dir is not None:  # (the job's subdirectory of the sweep: its number by default)
        parts.append(os.path.relpath(os.path.abspath(output_dir), os.path.abspath(sweep_dir)))
    return os.path.abspath(os.path.join(*parts, "checkpoints"))


def resolve_checkpoint(c: CheckpointConfig, experiment: Optional[str], output_dir: str,
                       sweep_dir: Optional[str], output_named_by_time: bool) -> CheckpointConfig:
    """A copy of ``c`` with ``dir`` set from ``experiment`` when it is null; raises when
    ``resume=auto`` could only look in this submission's new output directory."""
    check_experiment(experiment)
    if c.dir is not None:
        return c
    if experiment is not None:
        return dataclasses.replace(
            c, dir=experiment_checkpoint_dir(experiment, output_dir, sweep_dir))
    if c.resume == "auto" and output_named_by_time:
        raise ConfigError(
            "checkpoint.resume=auto: checkpoint.dir is null, so checkpoints go to "
            f"<output dir>/checkpoints ({os.path.join(output_dir, 'checkpoints')}), and the "
            "output directory is new for every submission (hydra.run.dir is named by the "
            "time): a resubmission would find nothing and start at step 0. Set "
            "experiment=NAME (checkpoints in outputs/NAME/checkpoints, the same for every "
            "submission of that experiment), or checkpoint.dir=PATH, or a fixed "
            "hydra.run.dir=PATH")
    return c
