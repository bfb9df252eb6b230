"""Registers the schemas in Hydra's ConfigStore under ``schema/<group>/<name>``.

The YAML files in ``conf/`` name these in their defaults lists, so Hydra type-checks every
composed value and rejects unknown keys given on the command line.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from automodel.config import schema as s

# group -> {option name -> schema class}; ``resolve.py`` uses the same table in reverse.
SCHEMAS = {
    "parallelism": {
        "none": s.SingleProcessConfig,
        "ddp": s.DDPConfig,
        "fsdp2": s.FSDP2Config,
        "megatron_fsdp": s.MegatronFSDPConfig,
    },
    "pipeline": {"pipeline": s.PipelineConfig},
    "mesh": {"default": s.MeshConfig},
    "distributed": {"default": s.DistributedConfig},
    "model": {"default": s.ModelConfig},
    "data": {
        "corpus": s.CorpusDataConfig,
        "synthetic": s.SyntheticDataConfig,
        "files": s.FilesDataConfig,
        "hf": s.HFDataConfig,
        "tokens": s.TokensDataConfig,
    },
    "optim": {"adamw": s.OptimConfig},
    "trainer": {"default": s.TrainerConfig},
    "logger": {"default": s.LoggerConfig},
    "checkpoint": {"default": s.CheckpointConfig},
}


def register_schemas() -> None:
    cs = ConfigStore.instance()
    for group, options in SCHEMAS.items():
        for name, cls in options.items():
            cs.store(group=f"schema/{group}", name=name, node=cls)
