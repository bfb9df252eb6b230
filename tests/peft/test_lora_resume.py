"""Resuming a LoRA run: exact in its own layout, across layouts (TP2 to PP2) to fp32 rounding;
and a checkpoint that does not fit the run (no peft, another rank, other layers, another base)
is refused before launch, saying what it holds."""

import numpy as np
import pytest

from automodel.api import load_config
from automodel.checkpoint.paths import checkpoint_path
from automodel.checks.preflight import check_resume_checkpoint
from automodel.config.build import ConfigError
from tests.helpers import FP32, job_overrides, train

LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8"]
RUN = ["trainer.max_steps=6", "checkpoint.every_steps=3"] + LORA
TP2 = ["parallelism=fsdp2", FP32, "mesh.tp_size=2"]


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """(the uninterrupted TP2 records, the step-3 checkpoint of a TP2 run stopped there)."""
    root = tmp_path_factory.mktemp("lora_tp2")
    full = train(TP2 + RUN, root / "full")
    first = train(TP2 + RUN + ["trainer.stop_at_step=3"], root / "split")
    assert [r["step"] for r in first] == [1, 2, 3]
    return full, checkpoint_path(str(root / "split" / "checkpoints"), 3)


def _steps(records, key):
    return [r[key] for r in records]


def test_resume_is_exact_in_its_layout_and_continues_under_a_pipeline(tp2_run, tmp_path):
    full, ckpt = tp2_run
    again = train(TP2 + RUN + [f"checkpoint.resume={ckpt}"], tmp_path / "tp2")
    assert _steps(again, "step") == [4, 5, 6]
    assert _steps(again, "loss") == _steps(full[3:], "loss")  # (bit for bit)
    assert _steps(again, "grad_norm") == _steps(full[3:], "grad_norm")
    pp2 = train(["parallelism=fsdp2", FP32, "pipeline=1f1b", "pipeline.pp_microbatch_size=2"]
                + RUN + [f"checkpoint.resume={ckpt}"], tmp_path / "pp2")
    np.testing.assert_allclose(_steps(pp2, "loss"), _steps(full[3:], "loss"), rtol=1e-5)
    np.testing.assert_allclose(_steps(pp2, "grad_norm"), _steps(full[3:], "grad_norm"),
                               rtol=1e-4)
    # the adapters were restored (fresh ones start from the base: step 1's loss)
    assert pp2[0]["loss"] < full[0]["loss"] - 0.2


@pytest.mark.parametrize("change,expected", [
    ([], "resume it with peft=lora peft.rank=4"),
    (LORA[:1] + ["peft.rank=8", "peft.alpha=8"], "holds adapters of rank 4 and alpha 8.0; this "
                                                 "run asks for peft.rank=8"),
    (LORA + ["peft.target_modules=[q_proj,v_proj]"], "holds adapters on other layers"),
    (LORA + ["trainer.seed=7"], "was trained over another base model than this run's"),
    (LORA + ["peft.use_dora=true"], "holds adapters trained with peft.use_dora=False"),
    (["peft=qlora", "peft.rank=4", "peft.alpha=8", "peft.nf4_scaler_block_size=8",
      "mesh.tp_size=1"], "holds adapters trained with peft=lora; this run asks for "
                         "peft=qlora (peft.nf4_block_size=64 peft.nf4_scaler_block_size=8)"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_before_launch(change, expected, tp2_run,
                                                                 tmp_path):
    _, ckpt = tp2_run
    cfg = load_config(job_overrides(TP2 + ["trainer.max_steps=6", f"checkpoint.resume={ckpt}"]
                                    + change), str(tmp_path))
    with pytest.raises(ConfigError) as info:
        check_resume_checkpoint(cfg)
    assert expected in str(info.value)


@pytest.mark.parametrize("change,expected", [
    (LORA[:1] + ["peft.rank=8", "peft.alpha=64"], "holds adapters of rank 4 and alpha 8.0; "
                                                  "this run asks for peft.rank=8 peft.alpha=64"),
    (LORA + ["trainer.seed=7"], "was trained over another base model than this run's"),
    ([], "is a LoRA checkpoint"),
])
def test_a_checkpoint_to_start_from_gets_the_same_checks(change, expected, tp2_run, tmp_path):
    """``checkpoint.initial_load_path`` (a second stage's start) is checked as a resume is:
    adapters of another rank and alpha, or trained over another base, are refused."""
    _, ckpt = tp2_run
    cfg = load_config(job_overrides(TP2 + ["trainer.max_steps=6",
                                           f"checkpoint.initial_load_path={ckpt}"] + change),
                      str(tmp_path))
    with pytest.raises(ConfigError) as info:
        check_resume_checkpoint(cfg)
    assert "checkpoint.initial_load_path" in str(info.value) and expected in str(info.value)


def test_a_full_checkpoint_does_not_resume_with_adapters(tmp_path):
    train(["parallelism=none", "trainer.max_steps=1", "checkpoint.every_steps=1"], tmp_path)
    ckpt = checkpoint_path(str(tmp_path / "checkpoints"), 1)
    cfg = load_config(job_overrides(LORA + [f"checkpoint.resume={ckpt}"]), str(tmp_path / "b"))
    with pytest.raises(ConfigError, match="holds a model trained without adapters"):
        check_resume_checkpoint(cfg)
