"""The registry of data sources (automodel/data/registry.py): a source added from outside
automodel trains with parity, and an unknown name or schema is refused with the allowed
names."""

from pathlib import Path

import pytest

from automodel.config.build import ConfigError
from automodel.data.registry import DATA_SOURCES, SHIPPED, DataSource, data_source
from tests.data.toy_source import TOY, ToyDataConfig
from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, TRAINER, train

CONF = Path(__file__).resolve().parents[1] / "conf"
TOY_OVERRIDES = [f"hydra.searchpath=[file://{CONF}]", "data=toy", "data.num_documents=100"]
ALLOWED = "Allowed: corpus, files, hf, synthetic, tokens"


def test_a_registered_source_trains_with_parity(tmp_path):
    # The toy source is 2 files (tests/data/toy_source.py, tests/conf/data/toy.yaml) and no
    # line of automodel: the same rows reach one process and two FSDP2 ranks.
    from automodel.api import load_config
    from automodel.data.sources import token_sequences

    cfg = load_config(["distributed.backend=gloo", *TRAINER, *TOY_OVERRIDES])
    assert (cfg.data_source, type(cfg.data), cfg.data.step) == ("toy", ToyDataConfig, 5)
    rows = token_sequences("toy", cfg.data, 32, 256)
    assert rows.shape == (100 * 40 // 33, 33)  # (the stream cut into rows of seq_len + 1)
    assert ((rows[:, 1:] - rows[:, :-1]) % 64 == 5).float().mean() > 0.9  # the toy's steps
    ref = train(["parallelism=none", *TOY_OVERRIDES], tmp_path / "ref", base=TRAINER)
    assert_matches(train(["parallelism=fsdp2", FP32, *TOY_OVERRIDES], tmp_path / "fsdp2",
                         base=TRAINER), ref)


@pytest.mark.fast
def test_an_unknown_source_is_refused_with_the_allowed_names(tmp_path):
    from automodel.api import compose
    from automodel.config.resolve import resolve
    from automodel.data.sources import token_rows

    # (the toy source of this module is registered too: it comes last)
    for refuse in (lambda: data_source("fiels"),
                   lambda: token_rows("fiels", ToyDataConfig(), 8, 256)):
        with pytest.raises(ConfigError) as err:
            refuse()
        assert str(err.value).startswith("data='fiels': no such data source. Did you mean "
                                         f"'files'? {ALLOWED}")
    cfg = compose(["data=synthetic"])
    cfg.data = {"num_sequences": 4}  # a data node no registered schema types
    with pytest.raises(ConfigError, match="'data' has no data source schema .*"
                       "- /schema/data@_here_: NAME.*corpus, files, hf, synthetic, tokens"):
        resolve(cfg, output_dir=str(tmp_path))


@pytest.mark.fast
def test_a_malformed_source_cannot_be_registered():
    with pytest.raises(ValueError, match="'toy' is already registered"):
        DATA_SOURCES.register(TOY)
    with pytest.raises(ValueError, match="ToyDataConfig is already 'toy'"):
        DATA_SOURCES.register(DataSource("toy2", ToyDataConfig, stream=TOY.stream))
    with pytest.raises(TypeError, match="exactly one of stream .* and rows"):
        DataSource("neither", ToyDataConfig)
    with pytest.raises(TypeError, match="needs an eval_fraction field"):
        DataSource("bare", type("Bare", (), {}), rows="x.y")
    assert "toy2" not in DATA_SOURCES and "toy" in DATA_SOURCES
    # every hook of the shipped sources, named by import path, imports
    hooks = ("stream", "rows", "held_out", "image_text", "image_check", "prepare")
    for source in SHIPPED:
        assert source.check is not None, source.name
        for which in hooks:
            assert getattr(source, which) is None or callable(source.hook(which)), which


@pytest.mark.fast
def test_a_source_without_image_text_samples_is_refused_before_launch(tmp_path):
    # data=tokens has no image_text hook: an image-text model is refused by the preflight
    # (it used to pass it and fail in every rank).
    import numpy as np

    from automodel.api import load_config
    from automodel.checks.preflight import check_model_layout

    np.save(tmp_path / "t.npy", np.arange(500) % 200)
    cfg = load_config(["model=llava_tiny", "data=tokens", f"data.path={tmp_path}/t.npy"])
    with pytest.raises(ConfigError, match="data=tokens with the image-text model "
                       "LlavaForConditionalGeneration: .* data=corpus, files, synthetic"):
        check_model_layout(cfg)
