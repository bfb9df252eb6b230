"""Tied embeddings through checkpoints and Hugging Face export, with and without a pipeline.

The pipeline's first and last stages each hold the shared weight under one name; a
checkpoint holds it once, loads into any layout, and the export is a tied model.
"""

import os

import numpy as np
from transformers import AutoModelForCausalLM

from automodel.checkpoint.paths import checkpoint_path
from tests.distributed.test_checkpoint_layouts import assert_continues
from tests.distributed.test_hf_export import _loss_and_grad_norm_of
from tests.helpers import FP32, train

TIED = ["model=gemma_tiny"]
RUN = ["trainer.max_steps=6", "checkpoint.every_steps=3"] + TIED
PP = ["parallelism=fsdp2", FP32, "pipeline.pp_microbatch_size=2"]


def test_tied_pipeline_checkpoint_resumes_elsewhere_and_exports_tied(tmp_path):
    full = train(PP + ["pipeline=1f1b", "checkpoint.export_hf=true"] + RUN, tmp_path / "full")
    ckpt = checkpoint_path(str(tmp_path / "full" / "checkpoints"), 3)
    # the pipeline's checkpoint continues in one process and in a 2-stages-per-rank pipeline
    assert_continues(train(["parallelism=none", f"checkpoint.resume={ckpt}"] + RUN,
                           tmp_path / "one"), full)
    assert_continues(train(PP + ["pipeline=interleaved", f"checkpoint.resume={ckpt}"] + RUN,
                           tmp_path / "interleaved"), full)
    # the export is a tied model holding the step-3 weights: it gives step 4's loss
    hf = os.path.join(ckpt, "hf")
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    loss, grad_norm = _loss_and_grad_norm_of(hf, 3, RUN, tmp_path / "cfg")
    np.testing.assert_allclose(loss, full[3]["loss"], rtol=1e-5)
    np.testing.assert_allclose(grad_norm, full[3]["grad_norm"], rtol=1e-4)


def test_unsplit_tied_checkpoint_resumes_in_a_pipeline(tmp_path):
    layout = ["parallelism=fsdp2", FP32]
    full = train(layout + RUN, tmp_path / "full")
    ckpt = checkpoint_path(str(tmp_path / "full" / "checkpoints"), 3)
    resumed = train(PP + ["pipeline=1f1b", f"checkpoint.resume={ckpt}"] + RUN, tmp_path / "pp")
    assert_continues(resumed, full)
