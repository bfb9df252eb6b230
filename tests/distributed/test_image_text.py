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
from tests.distributed.test_golden import assert_golden
from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, train

VLM = ["model=llava_tiny", "model.freeze=[vision]"]
FSDP2 = ["parallelism=fsdp2", FP32, "mesh.dp_size=2"]


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_frozen_tower_matches_single_process(policy, reference, tmp_path):
    overrides = FSDP2 + VLM + [f"parallelism.multimodal.frozen_sharding={policy}",
                               "trainer.local_batch_size=2"]
    records = train(overrides, tmp_path)
    assert_matches(records, reference(*VLM))
    if policy == "root":  # also a golden run (tests/golden/image_text_dp2.json)
        assert_golden("image_text_dp2", records, overrides)


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


@pytest.mark.fast
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
    from automodel.data.image_text import IGNORE_INDEX, ImageFormat, add_images

    rows = torch.arange(40).remainder(9).view(4, 10)  # token 7 doubles as the image token
    fmt = ImageFormat(image_token_id=7, placeholder=(torch.tensor([0, 7, 7, 7]), None),
                      load=lambda ref: {"pixel_values": torch.full((1, 3, 2, 2),
                                                                   float(-1 if ref is None
                                                                         else ref))})
    data = add_images(rows, fmt, tokens_per_image=3, image_every=2)
    assert data.has_image.tolist() == [True, False, True, False]
    assert (data.sequences[0, 1:4] == 7).all() and (data.sequences[1] != 7).all()
    inputs, labels, extras = data[torch.tensor([2, 1, 0])].split()
    assert extras["pixel_values"][:, 0, 0, 0].tolist() == [2, 0]  # row order
    assert (labels[0, :3] == IGNORE_INDEX).all() and (labels[0, 3:] != IGNORE_INDEX).all()
    # rows without any image: a placeholder row with an image and nothing to learn
    inputs, labels, extras = data[1:2].split()
    assert inputs.shape[0] == 2 and extras["pixel_values"].shape[0] == 1
    assert (inputs[1, 1:4] == 7).all() and (labels[1] == IGNORE_INDEX).all()
    assert (extras["pixel_values"] == -1).all()


def _meta(preset):
    from omegaconf import OmegaConf

    from automodel.config.schema import ModelConfig
    from automodel.models.builder import build_meta_model

    preset = OmegaConf.load(f"conf/model/{preset}.yaml")
    preset.pop("defaults")
    return build_meta_model(OmegaConf.to_object(OmegaConf.merge(
        OmegaConf.structured(ModelConfig), preset)))


@pytest.mark.fast
def test_vision_tower_as_one_unit():
    from automodel.distributed.fsdp2 import tower_as_one_unit
    from automodel.models.parts import block_fqns

    for preset, tower in [("llava_tiny", "model.vision_tower"), ("qwen2_vl_tiny", "model.visual"),
                          ("gemma3_vl_tiny", "model.vision_tower")]:
        model = _meta(preset)
        units = tower_as_one_unit(model, block_fqns(model))
        assert units[0] == tower and all(u.startswith("model.language_model.") for u in units[1:])


@pytest.mark.fast
def test_qwen2_vl_trains_on_its_own_multi_axis_positions():
    # The step passes position_ids=None for a model that derives its positions from the images
    # (Qwen2-VL's 3-D rotary positions): the logits are those of the model's own positions,
    # not of plain 1-D positions 0..L-1.
    from transformers import AutoModelForImageTextToText

    from automodel.data.image_text import add_images, synthetic_format

    meta = _meta("qwen2_vl_tiny")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(meta.config)
    fmt, count = synthetic_format(meta.config, meta, seed=0)
    data = add_images(torch.randint(0, 250, (2, 17)), fmt, count)
    inputs, labels, extras = data.split()
    assert extras["position_ids"] is None and extras["mm_token_type_ids"].sum() == 2 * count
    ours = model(input_ids=inputs, **extras).logits
    own, _ = model.model.get_rope_index(inputs, extras["mm_token_type_ids"],
                                        extras["image_grid_thw"])
    args = {k: v for k, v in extras.items() if k != "position_ids"}
    torch.testing.assert_close(ours, model(input_ids=inputs, position_ids=own, **args).logits)
    plain = torch.arange(inputs.shape[1]).expand_as(inputs)
    assert not torch.allclose(ours, model(input_ids=inputs, position_ids=plain, **args).logits)


FAMILIES = {"qwen2_vl": ["model=qwen2_vl_tiny", "model.freeze=[vision]"],
            "gemma3": ["model=gemma3_vl_tiny", "model.freeze=[vision]"]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_with_mixed_batches(family, reference, tmp_path):
    # Qwen2-VL: patch-sequence images with grid sizes, its merger (the projector) trains while
    # the tower is frozen, multi-axis positions; Gemma 3: image tokens attend both ways
    # (token_type_ids), sliding-window layers. One rank without images at times; the frozen
    # tower joins the root unit, the merger's tower is one unit of its own.
    mixed = FAMILIES[family] + ["data.image_every=2"]
    records = train(FSDP2 + mixed + ["trainer.local_batch_size=1",
                                     "parallelism.multimodal.vision.unit=tower"], tmp_path)
    assert_matches(records, reference(*mixed))


def test_trainable_tower_as_one_unit_kept_gathered(reference, tmp_path):
    # multimodal.vision: the whole (trainable) tower one FSDP2 unit, not resharded after forward
    run = ["model=llava_tiny", "data.image_every=2"]
    records = train(FSDP2 + run + ["trainer.local_batch_size=1",
                                   "parallelism.multimodal.vision.unit=tower",
                                   "parallelism.multimodal.vision.reshard_after_forward=false"],
                    tmp_path)
    assert_matches(records, reference(*run))


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
