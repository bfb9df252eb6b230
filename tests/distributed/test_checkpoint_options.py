"""What the last save keeps and what a load reads: ``checkpoint.export_hf`` (never, final,
every), ``export_dtype``, ``last_save_model_only``, ``exclude_from_loading`` and
``initial_load_path``. Each test reads what was written, or observes what a load took.

One job writes the checkpoints the others start from: FSDP2 over 2 gloo ranks, 4 steps, a
save every 2; the runs that load them use DDP (another layout).
"""

import os

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader

from automodel.api import load_config
from automodel.checkpoint.paths import checkpoint_path
from automodel.checks.preflight import preflight
from automodel.config.build import ConfigError
from tests.helpers import FP32, train

SAVED = ["parallelism=fsdp2", FP32, "mesh.dp_size=2", "trainer.max_steps=4",
         "checkpoint.every_steps=2"]
LOADS = ["parallelism=ddp", "trainer.max_steps=3"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(records, checkpoint root) of the job with ``export_hf=final``, bf16 exports and a
    model-only last checkpoint."""
    out = tmp_path_factory.mktemp("saved")
    records = train(SAVED + ["checkpoint.export_hf=final", "checkpoint.export_dtype=bfloat16",
                             "checkpoint.last_save_model_only=true"], out)
    return records, str(out / "checkpoints")


def _keys(path: str) -> set:
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def test_the_last_save_keeps_the_model_and_its_export(saved):
    """``last_save_model_only``: step 4's checkpoint holds no optimizer state, step 2's does;
    ``export_hf=final``: only step 4 has ``hf``, in bfloat16 (``export_dtype``), config too."""
    _, root = saved
    first, last = checkpoint_path(root, 2), checkpoint_path(root, 4)
    assert any(k.startswith("optim.") for k in _keys(first))
    assert not any(k.startswith("optim.") for k in _keys(last))
    assert {k for k in _keys(first) if k.startswith("model.")} == _keys(last)
    assert not os.path.exists(os.path.join(first, "hf"))
    with safe_open(os.path.join(last, "hf", "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert '"dtype": "bfloat16"' in open(os.path.join(last, "hf", "config.json")).read()


@pytest.mark.fast  # one process, no process group
def test_export_hf_names_when(tmp_path):
    cfg = lambda v: load_config([f"checkpoint.export_hf={v}"], str(tmp_path)).checkpoint  # noqa
    assert [cfg(v).export_hf for v in ("never", "final", "every", "true", "false")] == \
        ["never", "final", "every", "every", "never"]
    with pytest.raises(ConfigError, match="checkpoint.export_hf='sometimes': use never, final"):
        cfg("sometimes")
    with pytest.raises(ConfigError, match=r"'model' names nothing a load reads; name any of "
                                          r"optimizer, scheduler, step, rng"):
        load_config(["checkpoint.exclude_from_loading=[model]"], str(tmp_path))
    with pytest.raises(ConfigError, match="checkpoint.export_dtype='int8'"):
        load_config(["checkpoint.export_dtype=int8"], str(tmp_path))


def test_loads_leave_out_what_they_are_told(saved, tmp_path):
    """From step 2 (saved under FSDP2), loaded under DDP:
    - ``exclude_from_loading=[optimizer]``: step 3 starts from the same weights and batch as
      the saving run's step 3 (the same loss), but a fresh AdamW moves them differently
      (step 4's loss differs);
    - ``[optimizer, scheduler, step]`` and ``initial_load_path``: a run of steps 1..3 from
      those weights, with the LR warm-up of a fresh run; the two give the same numbers;
    - a model-only checkpoint resumes only with the optimizer left out (refused before
      launch otherwise)."""
    records, root = saved
    step2 = checkpoint_path(root, 2)
    fresh = train(LOADS, tmp_path / "fresh")
    no_optim = train(["parallelism=ddp", "trainer.max_steps=4", f"checkpoint.resume={step2}",
                      "checkpoint.exclude_from_loading=[optimizer]"], tmp_path / "no_optim")
    assert [r["step"] for r in no_optim] == [3, 4]
    assert no_optim[0]["loss"] == pytest.approx(records[2]["loss"], rel=1e-5)
    assert no_optim[1]["loss"] != pytest.approx(records[3]["loss"], rel=1e-5)
    weights = train(LOADS + [f"checkpoint.resume={step2}",
                             "checkpoint.exclude_from_loading=[optimizer,scheduler,step]"],
                    tmp_path / "weights")
    initial = train(LOADS + [f"checkpoint.initial_load_path={step2}"], tmp_path / "initial")
    assert [r["step"] for r in weights] == [r["step"] for r in initial] == [1, 2, 3]
    assert [r["lr"] for r in weights] == [r["lr"] for r in fresh]
    assert [r["loss"] for r in weights] == pytest.approx([r["loss"] for r in initial], rel=1e-6)
    assert weights[0]["loss"] < fresh[0]["loss"] - 0.05  # (the trained weights)
    last = checkpoint_path(root, 4)
    with pytest.raises(ConfigError, match=r"holds the model's weights only .* "
                                          r"checkpoint.exclude_from_loading=\[optimizer\]"):
        preflight(load_config(LOADS + [f"checkpoint.resume={last}"], str(tmp_path / "x")))


@pytest.mark.fast  # one process, no process group
def test_initial_load_path_must_be_a_complete_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path='.*nowhere': no such"):
        load_config([f"checkpoint.initial_load_path={tmp_path / 'nowhere'}"], str(tmp_path))
    (tmp_path / "half").mkdir()
    cfg = load_config([f"checkpoint.initial_load_path={tmp_path / 'half'}"], str(tmp_path))
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_path: checkpoint .*half is "
                                          r"incomplete \(no trainer.json\)"):
        preflight(cfg)
