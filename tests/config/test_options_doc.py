"""docs/options.md documents every option: each field of each schema a config can use has an
entry (its full key in backticks in a table row or a heading of that page)."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from automodel.config import schema as s
from automodel.config import strategies
from automodel.config.plan_schema import PlanConfig
from automodel.config.store import SCHEMAS
from automodel.data.registry import SHIPPED

pytestmark = pytest.mark.fast

DOC = Path(__file__).resolve().parents[2] / "docs" / "options.md"

# The key prefix of every schema a config node is built from (nested dataclasses such as
# FSDP2Config.multimodal or LoggerConfig.wandb are reached through their parent's field).
PREFIXES = {
    s.DistributedConfig: "distributed",
    s.MeshConfig: "mesh",
    **{entry.schema: "parallelism" for entry in strategies.SHIPPED},  # (config/strategies.py)
    s.PipelineConfig: "pipeline",
    s.ModelConfig: "model",
    **{source.schema: "data" for source in SHIPPED},  # (data/registry.py)
    s.OptimConfig: "optim",
    s.TrainerConfig: "trainer",
    s.CheckpointConfig: "checkpoint",
    s.LoggerConfig: "logger",  # its one field leads to WandbConfig: logger.wandb.*
    s.PeftConfig: "peft",
    PlanConfig: "plan",  # (plan.py's node: conf/plan.yaml)
}


def _nested_dataclass(tp):
    """The dataclass a field holds (also through Optional[...]), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def option_keys(cls, prefix: str) -> list[str]:
    """``prefix.field`` for every field of ``cls``, recursing into nested dataclasses."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        keys.append(key)
        nested = _nested_dataclass(hints[f.name])
        if nested is not None:
            keys.extend(option_keys(nested, key))
    return keys


def all_option_keys() -> set[str]:
    keys = set()
    for cls, prefix in PREFIXES.items():
        keys.update(option_keys(cls, prefix))
    return keys


def documented_keys(text: str) -> set[str]:
    """Backticked words of the table rows and headings of the page."""
    found = set()
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("|") or stripped.startswith("#"):
            found.update(re.findall(r"`([^`\s]+)`", stripped))
    return found


def test_every_schema_used_in_a_config_has_a_prefix():
    # A new config group or option file must be mapped here (and documented).
    used = {cls for options in SCHEMAS.values() for cls in options.values()}
    assert used == set(PREFIXES), sorted(c.__name__ for c in used ^ set(PREFIXES))
    for group, options in SCHEMAS.items():
        for cls in options.values():
            assert PREFIXES[cls] == group, (cls.__name__, group)


def test_nested_schemas_are_walked():
    keys = all_option_keys()
    assert {"parallelism.multimodal.frozen_sharding", "parallelism.multimodal.vision",
            "logger.wandb.mode", "logger.wandb.dir", "parallelism.bucket_cap_mb",
            "parallelism.zero_dp_strategy", "data.tokenizer_path"} <= keys


def test_every_option_is_documented():
    documented = documented_keys(DOC.read_text(encoding="utf-8"))
    missing = sorted(all_option_keys() - documented)
    assert not missing, (f"{len(missing)} option(s) without an entry in docs/options.md "
                         f"(the key in backticks in a table row or heading): "
                         f"{', '.join(missing)}")


def test_the_check_sees_a_missing_entry():
    text = DOC.read_text(encoding="utf-8")
    assert "`parallelism.bucket_cap_mb`" in text
    without = "\n".join(line for line in text.splitlines()
                        if "`parallelism.bucket_cap_mb`" not in line)
    assert "parallelism.bucket_cap_mb" in all_option_keys() - documented_keys(without)
    # a key mentioned only in running text is not an entry
    assert "mesh.dp_size" not in documented_keys("Set `mesh.dp_size` to 2.")


@pytest.mark.fast
def test_options_doc_lists_every_config_group_file():
    """The config-group paragraph at the top of docs/options.md names every file of every
    group in conf/."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index("Config groups (`conf/`")
    paragraph = text[start:text.index("\n\n", start)]
    named = set(re.findall(r"`([\w/]+)`", paragraph))
    conf = DOC.parents[1] / "conf"
    missing = [f"{group.name}/{f.stem}" for group in sorted(conf.iterdir())
               if group.is_dir() and group.name != "hydra"
               for f in sorted(group.glob("*.yaml")) if f.stem not in named]
    assert not missing, f"docs/options.md's config-group list lacks {missing}"
