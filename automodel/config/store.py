"""Registers the schemas in Hydra's ConfigStore under ``schema/<group>/<name>``.

The YAML files in ``conf/`` name these in their defaults lists, so Hydra type-checks every
composed value and rejects unknown keys given on the command line.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

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


# (group, name) -> (schema class, the node stored for it): a schema whose node is still the
# store's is not stored again (each store builds a structured config: 60 ms a composition)
_STORED: dict = {}


def register_schemas() -> None:
    """Store every schema, the strategies and data sources registered by now included (one
    registered outside automodel too); one stored before, and still in the store, is kept."""
    cs = ConfigStore.instance()
    registered = {"parallelism": strategies.STRATEGIES, "data": DATA_SOURCES}
    for group, options in SCHEMAS.items():
        if group in registered:
            options = {entry.name: entry.schema for entry in registered[group]}
        stored = cs.repo.get("schema", {}).get(group, {})
        for name, cls in options.items():
            kept = _STORED.get((group, name))
            if kept is not None and kept[0] is cls and stored.get(f"{name}.yaml") is kept[1]:
                continue
            cs.store(group=f"schema/{group}", name=name, node=cls)
            _STORED[group, name] = cls, cs.repo["schema"][group][f"{name}.yaml"]
