"""Every image-text family transformers ships: it trains under FSDP2 dp2 like one process, or
it is refused before launch, naming what is missing.

Each family is a tiny model made from its own default config (``tests/tiny_image_text.py``:
one shrinking rule set, nothing per family), fed generated images in the inputs derived from
its own signatures and config (``automodel/models/image_inputs.py``): per-image sizes, patch
attention masks, several crops per image, patch sequences with grids. One step on two gloo
ranks, one of them without any image (its placeholder image runs the tower), must give the
loss and gradient norm of the same global batch in one process (fp32).
"""

import dataclasses
import importlib.util
import logging
import warnings

import pytest
import torch

from tests.helpers import FP32, run_on_ranks
from tests.tiny_image_text import tiny_config

COVERED = [
    "aya_vision", "cohere2_vision", "cosmos3_edge", "cosmos3_omni", "deepseek_vl", "dots3_note",
    "exaone4_5", "gemma3", "glm46v", "glm4v", "glm4v_moe", "glm5_next", "glm_ocr", "glmga",
    "got_ocr2", "hy_v4_vl", "hyperclovax_vision_v2", "idefics2", "idefics3", "internvl", "janus",
    "lfm3_vl", "lighton_ocr", "llava", "llava_next", "llava_next_video", "llava_onevision",
    "minimax_m3_vl", "mistral3", "mistral_large4", "ovis2", "paligemma", "pp_chart2table",
    "qianfan_ocr", "qwen2_5_omni_thinker", "qwen2_5_vl", "qwen2_vl", "qwen3_5", "qwen3_5_moe",
    "qwen3_omni_moe_thinker", "qwen3_vl", "qwen3_vl_moe", "qwen4_exp", "shieldgemma2",
    "smolvlm", "step3p7", "video_llava", "vipllava",
]

# Refused for a package that is not installed here (checked only while it is not).
# no vision_config, but a causal-LM class: built as text models (their text part)
TEXT_ONLY = ["emu3", "fuyu"]
NEEDS_PACKAGE = {"fast_vlm": "timm", "gemma3n": "timm", "perception_lm": "timm",
                 "inkling_mm_model": "scipy"}

# Refused before launch (the preflight check on the meta-device build), with what it names.
REFUSED = {
    "aria": "Number of patches 16 not found",  # (its projector knows real image sizes only)
    "blip": "has no get_image_features",
    "blip-2": "is an encoder-decoder model",
    "deepseek_vl_hybrid": "needs high_res_pixel_values",
    "ernie4_5_vl_moe": "does not run on one image",
    "git": "has no get_image_features",
    "granite_docling": "does not run on one image",  # (its mask is per tile)
    "idefics": "has no get_image_features",
    "inkling2": "does not run on one image",
    "inkling2_loop": "does not run on one image",
    "instructblip": "is an encoder-decoder model",
    "instructblipvideo": "is an encoder-decoder model",
    "kimi_k25": "does not run on one image",
    "kosmos-2": "has no image_token_id",
    "kosmos-2.5": "needs flattened_patches",
    "lfm2_vl": "needs spatial_shapes",
    "minicpm_ocr": "needs no pixel_values",
    "minicpmv4_6": "needs no pixel_values",
    "minicpmv4_7": "needs no pixel_values",
    "mllama": "has no get_image_features",
    "molmo2": "needs image_token_pooling, image_grids",
    "muse_glimmer": "does not run on one image",
    "muse_spark": "does not run on one image",
    "nemotron_h_omni": "needs image_grid_hw",
    "paddleocr_vl": "does not run on one image",
    "pix2struct": "is an encoder-decoder model",
    "pp_formulanet": "is an encoder-decoder model",
    "unlimited_ocr": "vision_config has no image_size",
    "video_llama_3": "does not run on one image",
    "llama4": "does not run on one image",  # (its default sizes disagree: fc1 vs pixel shuffle)
    "florence2": "is an encoder-decoder model",
    "gemma4": "vision_config has no image_size",  # (patch sequences with position ids)
    "gemma4_unified": "vision_config has no image_size",
    "apertus1p5": "vision_config has no image_size",  # (a VQ image tokenizer)
    # No vision_config, and no causal-LM class to build instead:
    "chameleon": "with vq_config and no vision_config",
    "evolla": "with protein_encoder_config and no vision_config",
    "mistral4": "neither a vision_config nor a causal-LM class",
    "pi0": "with vlm_config, dit_config and no vision_config",
    "t5gemma2": "is an encoder-decoder model",
    "udop": "is an encoder-decoder model",
    "vision-encoder-decoder": "is an encoder-decoder model",
    # transformers' own default config of these does not build (nor, so, its tiny copy):
    "cohere_compass": "cannot build .*KeyError: 'full_attention'",
    "deepseek_ocr2": "cannot build .*TypeError",
    "diffusion_gemma": "cannot build .*TypeError",
    "granite4_vision": "cannot build .*TypeError",
    "hunyuan_vl": "cannot build .*TypeError",
}


def _base_config(tmp_path):
    from automodel.api import load_config

    return load_config(["parallelism=fsdp2", FP32, "mesh.dp_size=2", "model=llava_tiny",
                        "data=synthetic", "trainer.global_batch_size=4"], str(tmp_path))


def _with_model(cfg, model_type):
    from automodel.config.schema import ModelConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dataclasses.replace(cfg, model=ModelConfig(config=tiny_config(model_type)))


def _batch(cfg, multiple: int = 1):
    """Four rows; only the first has an image: rank 1 of two holds none. ``multiple``: the
    inputs' length is a multiple of it (context parallelism: of 2 * cp)."""
    from automodel.data.image_text import add_images, synthetic_format
    from automodel.models.builder import build_meta_model

    meta = build_meta_model(cfg.model)
    fmt, count = synthetic_format(meta.config, meta, seed=0)
    width = -(-(count + 8) // multiple) * multiple + 1
    rows = torch.randint(0, 250, (4, width), generator=torch.Generator().manual_seed(0))
    return add_images(rows, fmt, count, image_every=4)


def _one_step(cfg, setup, data, rows):
    from automodel.models.builder import build_model
    from automodel.parallelize import parallelize
    from automodel.recipes.components import initial_model
    from automodel.recipes.step import train_step

    if setup.mesh is None:  # one process: the model built whole, as a lone process does
        parts = parallelize(build_model(cfg.model, cfg.trainer.seed), setup)
    else:  # the ranks' path: meta-device model, this rank's shards filled after sharding
        model, fill = initial_model(cfg, setup.dist)
        parts = parallelize(model, setup, fill)
    stats = train_step(parts.parts[0], setup, [data[rows].split()], None,
                       head_loss=parts.head_loss)
    return float(stats.loss), float(stats.grad_norm)


def _parity(rank, world, cfg, families):
    from automodel.distributed.init import DistInfo
    from automodel.recipes.train import build_setup

    warnings.simplefilter("ignore")
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    results = {}
    for family in families:
        run = _with_model(cfg, family)
        data = _batch(run)
        setup = build_setup(run, info)
        one = dataclasses.replace(setup, strategy="none", mesh=None, cp=None)
        results[family] = {
            "dp2": _one_step(run, setup, data, slice(2 * rank, 2 * rank + 2)),
            "one": _one_step(run, one, data, slice(0, 4)) if rank == 0 else None,
            "image_rows": int(data[slice(2 * rank, 2 * rank + 2)].has_image.sum())}
    return results


def test_every_covered_family_trains_like_one_process(tmp_path):
    cfg = _base_config(tmp_path)
    ranks = run_on_ranks(_parity, 2, cfg, COVERED, tmp_path=tmp_path)
    assert [ranks[r]["llava"]["image_rows"] for r in range(2)] == [1, 0]
    for family in COVERED:
        dp2, one = ranks[0][family]["dp2"], ranks[0][family]["one"]
        assert ranks[1][family]["dp2"] == dp2, family  # one global loss and norm
        assert dp2 == pytest.approx(one, rel=1e-5), family


@pytest.mark.fast
def test_other_families_are_refused_before_launch(tmp_path, caplog):
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as FAMILIES,
    )

    from automodel.checks.preflight import check_model_layout
    from automodel.config.build import ConfigError

    cfg = _base_config(tmp_path)
    assert not set(COVERED) & set(REFUSED) and set(COVERED) | set(REFUSED) <= set(FAMILIES)
    # every family is covered, refused (or needs a package), or built as text; a family of a
    # newer transformers (within the pinned range) that these tables do not know yet is
    # either refused before launch, naming it, or passes the preflight's checks
    known = set(COVERED) | set(REFUSED) | set(NEEDS_PACKAGE) | set(TEXT_ONLY)
    for family in sorted(set(FAMILIES) - known):
        try:
            check_model_layout(_with_model(cfg, family))
        except ConfigError as err:
            assert f"model_type {family!r}" in str(err) or FAMILIES[family] in str(err), err
    missing = {f: f"needs the package '{p}', which is not installed: pip install {p}"
               for f, p in NEEDS_PACKAGE.items() if importlib.util.find_spec(p) is None}
    for family, reason in {**REFUSED, **missing}.items():
        with pytest.raises(ConfigError, match=reason):
            check_model_layout(_with_model(cfg, family))
    for family in COVERED[:3]:
        check_model_layout(_with_model(cfg, family))  # passes
    # image-text families without a vision_config but with a causal-LM class train as text,
    # and the user is told so
    for family in TEXT_ONLY:
        with caplog.at_level(logging.WARNING, logger="automodel.checks.preflight"):
            caplog.clear()
            check_model_layout(_with_model(cfg, family))
        assert f"model_type {family!r} is an image-text family without a vision_config" \
            in caplog.text, family


@pytest.mark.fast
def test_freeze_groups_resolve_for_every_covered_family():
    from automodel.config.schema import ModelConfig
    from automodel.models.builder import build_meta_model
    from automodel.models.multimodal import freeze

    for family in COVERED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_meta_model(ModelConfig(config=tiny_config(family)))
        for group in ("vision", "multimodal", "language"):
            frozen, total = freeze(model, [group])
            assert 0 < frozen < total, (family, group)
            for p in model.parameters():
                p.requires_grad_(True)
