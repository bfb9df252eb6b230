"""Async tensor parallelism overlaps collectives with compute only in compiled code: without
``parallelism.enable_compile=true`` it says so when the config is resolved (issue 23, item 13)."""

import logging

import pytest

from automodel.api import load_config

pytestmark = pytest.mark.fast  # no process, no process group

TP2_ASYNC = ["parallelism=fsdp2", "mesh.tp_size=2", "parallelism.enable_async_tensor_parallel=true"]
NEEDS_COMPILE = "without parallelism.enable_compile=true overlaps nothing"


def _warnings(caplog, *overrides) -> str:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="automodel"):
        load_config(list(overrides), env={})
    return caplog.text


def test_async_tp_without_compile_warns_naming_both_keys_and_the_fix(caplog):
    text = _warnings(caplog, *TP2_ASYNC)
    assert NEEDS_COMPILE in text
    assert "parallelism.enable_async_tensor_parallel=true" in text
    assert "set parallelism.enable_compile=true" in text


def test_async_tp_with_compile_or_without_tp_does_not_ask_for_compile(caplog):
    assert NEEDS_COMPILE not in _warnings(caplog, *TP2_ASYNC, "parallelism.enable_compile=true")
    text = _warnings(caplog, "parallelism=fsdp2", "parallelism.enable_async_tensor_parallel=true")
    assert NEEDS_COMPILE not in text and "no effect with mesh.tp_size=1" in text
    assert NEEDS_COMPILE not in _warnings(caplog, "parallelism=fsdp2", "mesh.tp_size=2")
