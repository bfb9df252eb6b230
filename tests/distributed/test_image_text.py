"""Image-text models with a frozen vision tower, in the data-parallel layouts.

A tiny LLaVA built from config (``conf/model/llava_tiny.yaml``) on the corpus text with
generated images (every sample an image, or every other one: ``data.image_every=2`` mixes both,
and some micro-batches then hold no image at all), its vision tower frozen
(``model.freeze=[vision]``), must match one process in losses and gradient norms (fp32, 5
steps) under FSDP2 dp2 with each ``parallelism.multimodal.frozen_sharding`` policy, under HSDP,
DDP and scoped activation checkpointing; the frozen weights must not move.
"""

import numpy as np
import pytest
import torch

from automodel.checkpoint.hf_export import load_full_model_state
from automodel.checkpoint.paths import checkpoint_path
from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, train

VLM = ["model=llava_tiny", "model.freeze=[vision]"]
FSDP2 = ["parallelism=fsdp2", FP32, "mesh.dp_size=2"]


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_frozen_tower_matches_single_process(policy, reference, tmp_path):
    records = train(FSDP2 + VLM + [f"parallelism.multimodal.frozen_sharding={policy}",
                                   "trainer.local_batch_size=2"], tmp_path)
    assert_matches(records, reference(*VLM))


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_ranks_with_and_without_images_in_one_step(policy, reference, tmp_path):
    # every other sample has an image: with local batch 1 one rank's micro-batch has an image
    # while its peer's has none; the image-less one carries a placeholder image (no labels),
    # so both ranks run the tower and the projector and reduce the same gradients
    mixed = VLM + ["data.image_every=2"]
    records = train(FSDP2 + mixed + [f"parallelism.multimodal.frozen_sharding={policy}",
                                     "trainer.local_batch_size=1"], tmp_path)
    assert_matches(records, reference(*mixed))


def test_frozen_weights_stay_and_the_rest_trains(tmp_path):
    from automodel.api import load_config
    from automodel.models.builder import build_model

    run = FSDP2 + VLM + ["trainer.max_steps=3", "checkpoint.every_steps=3"]
    train(run, tmp_path)
    cfg = load_config(run, str(tmp_path / "cfg"))
    initial = build_model(cfg.model, cfg.trainer.seed).state_dict()
    after = load_full_model_state(checkpoint_path(str(tmp_path / "checkpoints"), 3))
    vision = [k for k in after if "vision_tower" in k]
    assert vision
    for key in vision:
        assert torch.equal(initial[key], after[key]), key
    moved = [k for k in after if not torch.equal(initial[k], after[k])]
    assert any("multi_modal_projector" in k for k in moved)
    assert any("language_model" in k for k in moved)


OTHER = {  # more data-parallel layouts, mixed batches (one rank without images at times)
    "hsdp": ["parallelism=fsdp2", FP32, "mesh.dp_size=4", "mesh.dp_replicate_size=2"],
    "ac_language": FSDP2 + ["parallelism.activation_checkpointing=true",
                            "parallelism.activation_checkpointing_scope=[language]"],
    "ddp": ["parallelism=ddp", "mesh.dp_size=2"],
}


@pytest.mark.parametrize("name", sorted(OTHER))
def test_frozen_tower_in_other_layouts(name, reference, tmp_path):
    mixed = VLM + ["data.image_every=2"]
    records = train(OTHER[name] + mixed + ["trainer.local_batch_size=1"], tmp_path)
    assert_matches(records, reference(*mixed))


def freeze_first_language_layer(part):
    """A pre-shard hook (``parallelism.pre_shard_hook``) for the test below."""
    for p in part.model.language_model.layers[0].parameters():
        p.requires_grad_(False)


def test_pre_shard_hook_runs_before_wrapping(tmp_path):
    from automodel.api import load_config
    from automodel.models.builder import build_model

    hook = f"{__name__}.freeze_first_language_layer"
    run = FSDP2 + VLM + ["trainer.max_steps=2", "checkpoint.every_steps=2",
                         f"parallelism.pre_shard_hook={hook}"]
    train(run, tmp_path)
    cfg = load_config(run, str(tmp_path / "cfg"))
    initial = build_model(cfg.model, cfg.trainer.seed).state_dict()
    after = load_full_model_state(checkpoint_path(str(tmp_path / "checkpoints"), 2))
    first = [k for k in after if "language_model.layers.0." in k]
    assert first and all(torch.equal(initial[k], after[k]) for k in first)
    second = [k for k in after if "language_model.layers.1." in k]
    assert any(not torch.equal(initial[k], after[k]) for k in second)


def test_bad_pre_shard_hook_is_refused_before_launch(tmp_path):
    from automodel.api import load_config
    from automodel.config.build import ConfigError

    with pytest.raises(ConfigError, match="parallelism.pre_shard_hook='no.such.fn'"):
        load_config(FSDP2 + VLM + ["parallelism.pre_shard_hook=no.such.fn"], str(tmp_path))


def test_resume_and_hf_export(tmp_path):
    from transformers import AutoModelForImageTextToText

    from tests.distributed.test_checkpoint_layouts import assert_continues

    run = FSDP2 + VLM + ["trainer.max_steps=6", "checkpoint.every_steps=3",
                         "checkpoint.export_hf=true"]
    full = train(run, tmp_path / "full")
    train(run + ["trainer.stop_at_step=3"], tmp_path / "split")
    again = train(run + ["checkpoint.resume=auto"], tmp_path / "split")
    assert_continues(again, full)
    hf = tmp_path / "full" / "checkpoints" / "step_00000006" / "hf"
    model = AutoModelForImageTextToText.from_pretrained(hf)
    saved = load_full_model_state(checkpoint_path(str(tmp_path / "full" / "checkpoints"), 6))
    exported = model.state_dict()
    assert set(saved) <= set(exported)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    # and trains again from the export as a pretrained model (LLaVA stores its weights under
    # other names than its modules: rank 0 loads them and broadcasts)
    again = ["model=pretrained", f"model.pretrained_path={hf}", "model.freeze=[vision]",
             "trainer.max_steps=2"]
    ref = train(["parallelism=none"] + again, tmp_path / "ref")
    got = train(FSDP2 + again, tmp_path / "got")
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref],
                               rtol=1e-4)


@pytest.mark.fast
def test_image_rows_labels_and_placeholder():
    from automodel.data.image_text import IGNORE_INDEX, add_images

    rows = torch.arange(40).remainder(9).view(4, 10)  # token 7 doubles as the image token
    data = add_images(rows, image_token_id=7, tokens_per_image=3, image_shape=(3, 2, 2),
                      seed=0, image_every=2)
    assert data.has_image.tolist() == [True, False, True, False]
    assert (data.sequences[0, 1:4] == 7).all() and (data.sequences[1] != 7).all()
    inputs, labels, extras = data[0:2].split()
    assert extras["pixel_values"].shape == (1, 3, 2, 2)
    assert (labels[0, :3] == IGNORE_INDEX).all() and (labels[0, 3:] != IGNORE_INDEX).all()
    # rows without any image: a placeholder row with an image and nothing to learn
    inputs, labels, extras = data[1:2].split()
    assert inputs.shape[0] == 2 and extras["pixel_values"].shape[0] == 1
    assert (inputs[1, 1:4] == 7).all() and (labels[1] == IGNORE_INDEX).all()
    assert not extras["pixel_values"].any()


@pytest.mark.fast
def test_freeze_names_what_matches_nothing():
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.models.multimodal import freeze

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="'vision' matches no parameter of LlamaForCausalLM"):
        freeze(model, ["vision"])
    frozen, total = freeze(model, ["model.layers.0.*"])
    assert 0 < frozen < total
