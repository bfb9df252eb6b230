"""Options with a closed set of values are enums (automodel/config/enums.py): every value
docs/options.md lists composes and resolves to its member; any other value is refused before
anything starts, naming the key, the value, the allowed values and the closest one, on every
path a value comes in (the API, the command line, a plain mapping)."""

import functools
import itertools
import re
from pathlib import Path

import pytest

from automodel.api import load_config
from automodel.config import enums
from automodel.config.build import ConfigError, build
from automodel.config.cli_check import check_cli_overrides
from automodel.config.schema import LoggerConfig

pytestmark = pytest.mark.fast

DOC = Path(__file__).resolve().parents[2] / "docs" / "options.md"

# key -> (its enum, the group choices under which the key exists, a typo of a value)
OPTIONS = {
    "trainer.loss": (enums.Loss, [], "fussed"),
    "trainer.on_nonfinite": (enums.OnNonfinite, [], "skipp"),
    "parallelism.multimodal.frozen_sharding": (enums.FrozenSharding, ["parallelism=fsdp2"],
                                               "per-layer"),
    "parallelism.multimodal.vision.unit": (enums.VisionUnit, ["parallelism=fsdp2"], "towers"),
    "logger.wandb.mode": (enums.WandbMode, ["logger=wandb"], "offlne"),
}
CHOICES = sorted({c for _, groups, _ in OPTIONS.values() for c in groups})


def documented(key: str) -> list:
    """The values the type column of ``key``'s row in docs/options.md lists."""
    row = next(line for line in DOC.read_text().splitlines()
               if line.startswith(f"| `{key}` |"))
    kind = re.split(r"(?<!\\)\|", row)[2]  # (an escaped \| is inside a cell)
    assert "enum" in kind, row
    return re.findall(r"`([a-z_]+)`", kind)


def value_of(cfg, key: str):
    return functools.reduce(getattr, key.split("."), cfg)


def test_every_documented_value_composes_to_its_member():
    lists = {key: documented(key) for key in OPTIONS}
    for key, (enum, _, _) in OPTIONS.items():
        assert lists[key] == list(enum.values()), key
    # a few configs cover every value: the i-th sets the i-th value of each option
    for combo in itertools.zip_longest(*lists.values()):
        chosen = {k: v for k, v in zip(lists, combo) if v is not None}
        cfg = load_config(CHOICES + [f"{k}={v}" for k, v in chosen.items()], env={})
        for key, value in chosen.items():
            got = value_of(cfg, key)
            assert got is OPTIONS[key][0](value) and got == value and f"{got}" == value, key


@pytest.mark.parametrize("key", sorted(OPTIONS))
def test_a_value_outside_the_set_is_refused_naming_key_and_values(key):
    enum, groups, typo = OPTIONS[key]
    with pytest.raises(ConfigError) as err:
        load_config(groups + [f"{key}={typo}"], env={})
    message = str(err.value)
    allowed = ", ".join(enum.values())
    assert message.startswith(f"{key}={typo!r}: allowed: {allowed}"), message
    assert "Did you mean" in message, message
    # the command line (checked before Hydra composes) says the same
    with pytest.raises(ConfigError) as cli:
        check_cli_overrides(groups + [f"{key}={typo}"])
    assert str(cli.value) == message


def test_plain_mappings_are_converted_and_checked_at_the_boundary():
    logger = build(LoggerConfig, {"wandb": {"mode": "offline"}}, "logger")
    assert logger.wandb.mode is enums.WandbMode.offline
    assert build(LoggerConfig, {"wandb": {"mode": None}}, "logger").wandb.mode is None
    with pytest.raises(ConfigError, match=r"logger.wandb.mode='on': allowed: online, offline, "
                                          r"disabled, or null"):
        build(LoggerConfig, {"wandb": {"mode": "on"}}, "logger")


def test_activation_checkpointing_keeps_its_booleans():
    """The AC mode takes false/true as before, and full/selective; it resolves to an
    ``ACMode`` member; a typo is refused with the closest value."""
    for value, mode in (("false", "none"), ("true", "full"), ("selective", "selective")):
        cfg = load_config(["parallelism=fsdp2", f"parallelism.activation_checkpointing={value}"],
                          env={})
        assert cfg.activation_checkpointing is enums.ACMode(mode)
    with pytest.raises(ConfigError) as err:
        load_config(["parallelism.activation_checkpointing=selectiv"], env={})
    assert str(err.value) == ("parallelism.activation_checkpointing='selectiv': allowed: false, "
                              "true, 'full', 'selective'. Did you mean 'selective'?")
