"""LoRA under data parallelism: losses and the adapters' gradient norms match one process
(fp32), with gradient accumulation too; the default precision trains close to fp32; and the
base weights really stay as loaded while the adapters move (read back from the run's
checkpoint: FSDP2 shards frozen and trainable weights in the same units)."""

import glob

import pytest
import torch

from automodel.api import load_config
from automodel.checkpoint.hf_export import load_full_model_state
from automodel.models.builder import build_model
from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
from tests.helpers import FP32, job_overrides, train

LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8"]


@pytest.mark.parametrize("layout", [
    ["parallelism=ddp"],
    ["parallelism=fsdp2", FP32, "trainer.local_batch_size=2"],  # (2 micro-batches per step)
    ["parallelism=hsdp", FP32, "trainer.local_batch_size=1"],  # (2 x 2 ranks)
])
def test_lora_matches_one_process(layout, reference, tmp_path):
    records = train(layout + LORA, tmp_path)
    assert_matches(records, reference(*LORA))


def test_lora_trains_under_the_default_precision_and_leaves_the_base_as_it_was(reference,
                                                                                tmp_path):
    records = train(["parallelism=fsdp2", "checkpoint.every_steps=5"] + LORA, tmp_path)
    assert_close_to_fp32(records, reference(*LORA), loss_rtol=2e-2)
    (saved,) = glob.glob(str(tmp_path / "checkpoints" / "*"))
    state = load_full_model_state(saved)
    cfg = load_config(job_overrides(LORA))
    initial = build_model(cfg.model, seed=cfg.trainer.seed).state_dict()
    adapters = {k for k in state if ".lora_" in k}
    assert len(adapters) == 2 * 7 * 4  # A and B, 7 projections, 4 blocks
    assert set(state) - adapters == set(initial)  # (every base weight, under its own name)
    for name, value in initial.items():
        assert torch.equal(state[name], value), name  # frozen: as built
    b = [state[k] for k in adapters if k.endswith("lora_B.weight")]
    assert all(t.abs().max() > 0 for t in b)  # B started at zero and trained


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_lora_on_an_image_text_model_with_each_frozen_sharding_policy(policy, reference,
                                                                     tmp_path):
    # the language model's projections get adapters, the tower none: it is a frozen tower
    # (every other sample has an image: with one sample per rank, one rank has none). The LM
    # head gets adapters too, under the plain loss: with a frozen head of random weights the
    # logits hardly move in 5 steps, and parity needs a run that learns
    vlm = ["model=llava_tiny", "data.image_every=2", "trainer.loss=plain",
           "peft.target_modules=[*language_model*_proj,lm_head]"] + LORA
    records = train(["parallelism=fsdp2", FP32, "trainer.local_batch_size=1",
                     f"parallelism.multimodal.frozen_sharding={policy}"] + vlm, tmp_path)
    assert_matches(records, reference(*vlm))
