"""automodel's command line: ``python train.py [group=option ...] [key=value ...]``.

Thin on purpose: Hydra composes ``conf/``; everything else lives in ``automodel``. torch is
not imported here, so ``--cfg job`` and config errors are instant.
"""

import hydra

from automodel.cli import prepare_argv, run_from_hydra
from automodel.config.store import register_schemas

register_schemas()
prepare_argv()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    return run_from_hydra(cfg)


if __name__ == "__main__":
    main()
