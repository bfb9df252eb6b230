"""Registers the schemas in Hydra's ConfigStore under ``schema/<group>/<name>``.

The YAML files in ``conf/`` name these in their defaults lists, so Hydra type-checks every
composed value and rejects unknown keys given on the command line.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from automodel.config import schema as s
from automodel.config import strategies
from automodel.config.plan_schema import PlanConfig
from automodel.data.registry import DATA_SOURCES, SHIPPED

# group -> {option name -> schema class} of the shipped options. The strategies and the data
# sources are their registries' (``config/strategies.py``, ``data/registry.py``), which
# ``resolve.py`` asks for the entry of a composed node's schema.
SCHEMAS = {
    "parallelism": {entry.name: entry.schema for entry in strategies.SHIPPED},
    "pipeline": {"pipeline": s.PipelineConfig},
    "mesh": {"default": s.MeshConfig},
    "distributed": {"default": s.DistributedConfig},
    "model": {"default": s.ModelConfig},
    "data": {source.name: source.schema for source in SHIPPED},
    "optim": {"adamw": s.OptimConfig},
    "trainer": {"default": s.TrainerConfig},
    "logger": {"default": s.LoggerConfig},
    "checkpoint": {"default": s.CheckpointConfig},
    "peft": {"default": s.PeftConfig},
    "plan": {"default": PlanConfig},  # (plan.py only)
}


def register_schemas() -> None:
    """Store every schema, the strategies and data sources registered by now included (one
    registered outside automodel too). A schema whose node in the store was built from the
    same class is kept: storing builds a structured config again (19 ms a composition)."""
    cs = ConfigStore.instance()
    registered = {"parallelism": strategies.STRATEGIES, "data": DATA_SOURCES}
    for group, options in SCHEMAS.items():
        if group in registered:
            options = {entry.name: entry.schema for entry in registered[group]}
        stored = cs.repo.get("schema", {}).get(group, {})
        for name, cls in options.items():
            node = stored.get(f"{name}.yaml")
            if node is None or OmegaConf.get_type(node.node) is not cls:
                cs.store(group=f"schema/{group}", name=name, node=cls)
