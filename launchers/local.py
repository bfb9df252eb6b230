"""Run one job on this machine without Hydra's command line.

    python -m launchers.local [--output-dir DIR] [override ...]
    python -m launchers.local --rerun outputs/2026-01-01/12-00-00 [--output-dir DIR] [override ...]

The overrides are the same ``key=value`` / ``group=option`` strings ``train.py`` takes.
``--rerun`` repeats an earlier run from the overrides Hydra saved in its ``.hydra/`` folder
(later overrides win). Ranks are started exactly as ``train.py`` starts them.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path


def saved_overrides(run_dir: str) -> list[str]:
    import yaml

    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.is_file():
        raise SystemExit(f"--rerun {run_dir}: no {path} (not a train.py output directory)")
    return list(yaml.safe_load(path.read_text()) or [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launchers.local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", help="where metrics.jsonl and train.log go "
                        "(default: outputs/local/<timestamp>)")
    parser.add_argument("--rerun", metavar="RUN_DIR", help="repeat the run saved in RUN_DIR")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    from automodel.api import run
    from automodel.config.build import ConfigError
    from automodel.errors import CheckpointError, LaunchError, TrainingStopped

    overrides = (saved_overrides(args.rerun) if args.rerun else []) + args.overrides
    output_dir = args.output_dir or str(
        Path("outputs") / "local" / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    try:
        records = run(overrides, output_dir=output_dir)
    except ConfigError as err:
        print(f"automodel: configuration error:\n{err}", file=sys.stderr)
        return 2
    except (LaunchError, CheckpointError) as err:
        print(f"automodel: job failed:\n{err}", file=sys.stderr)
        return 1
    except TrainingStopped as stopped:  # saved; exit as train.py does (143 for SIGTERM)
        print(f"automodel: {stopped}", file=sys.stderr)
        return stopped.exit_code
    if records:
        print(f"final loss {records[-1]['loss']:.4f}; metrics in {output_dir}/metrics.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
