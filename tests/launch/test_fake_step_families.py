"""The preflight's fake step passes the families whose pipeline stages needed the runner's
help (positions and an embedding norm before the blocks, a decoder one level down, tied
embeddings): four pipelines of two stages, in this process on fake tensors. Not in the fast
tier (seconds: docs/contributing.md); the rest of the fake step's tests are
(tests/launch/test_fake_step.py)."""

import logging

import pytest

from automodel.api import load_config
from automodel.checks.preflight import preflight


@pytest.mark.parametrize("family", ["gpt2_tiny", "opt_tiny", "bloom_tiny", "gemma_tiny"])
def test_the_family_takes_a_pipeline_step(family, caplog):
    with caplog.at_level(logging.INFO, logger="automodel.checks.fake_step"):
        preflight(load_config(["data=synthetic", f"model={family}", "pipeline=1f1b",
                               "pipeline.pp_microbatch_size=2"]))  # (gemma: tied embeddings)
    # (stepped, not skipped: both pipeline ranks, one layer a stage)
    assert "pipeline=1f1b pp 2 on fake tensors (2 rank classes, 2 layers)" in caplog.text, \
        caplog.text
