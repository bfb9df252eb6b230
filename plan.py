"""Plan a training job before launching it: ``python plan.py [train.py's overrides] [plan.*]``.

Memory per rank class, bytes per mesh axis, the pipeline bubble and the step time on a GPU
profile, for any world size, on this CPU (docs/planning.md). Writes ``plan.json`` (and
``plan.png``) into the Hydra output directory. ``plan.search=true plan.gpus=N`` ranks the
layouts of N GPUs that fit instead.
"""

import hydra

from automodel.cli import prepare_argv
from automodel.config.store import register_schemas

register_schemas()
prepare_argv()


@hydra.main(version_base="1.3", config_path="conf", config_name="plan")
def main(cfg):
    from automodel.plan_cli import run_plan
    from automodel.prepare.admission import Admission

    return run_plan(cfg, Admission)


if __name__ == "__main__":
    main()
