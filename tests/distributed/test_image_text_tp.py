"""Image-text models under tensor parallelism, with and without sequence parallelism.

- the three presets (LLaVA, Qwen2-VL, Gemma 3) with a trainable tower, one image every other
  sample and one sample per micro-batch (micro-batches without an image), 5 steps: losses
  and gradient norms match one process (fp32); the default precision trains close to fp32;
- four more families (Mistral 3, Idefics 3, Qwen2.5-VL, Janus), one step each, TP2 and TP2+SP;
- the effect: the tower's weights whole on every TP rank, the language model's split; under
  SP the first language block takes its rank's half of the sequence, the tower and the merge
  the whole sequence;
- what the plan of a family cannot do is refused before launch, naming the layer.
"""

import dataclasses
import warnings

import pytest
import torch

from tests.distributed.test_image_text_families import _batch, _one_step, _with_model
from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
from tests.helpers import FP32, run_on_ranks, train

TP2 = ["parallelism=fsdp2", FP32, "mesh.tp_size=2"]
SP = ["parallelism.sequence_parallel=true"]
MIXED = ["data.image_every=2"]  # (one sample per micro-batch: half of them have no image)


@pytest.mark.parametrize("preset", ["llava_tiny", "qwen2_vl_tiny", "gemma3_vl_tiny"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_presets_match_one_process(preset, sp, reference, tmp_path):
    run = [f"model={preset}"] + MIXED
    records = train(TP2 + (SP if sp else []) + ["trainer.local_batch_size=1"] + run, tmp_path)
    assert_matches(records, reference(*run))


def test_the_default_precision_trains_close_to_fp32(reference, tmp_path):
    run = ["model=llava_tiny"] + MIXED
    records = train(["parallelism=fsdp2", "mesh.tp_size=2"] + SP + run, tmp_path)
    assert_close_to_fp32(records, reference(*run), loss_rtol=2e-2)


MORE = ["mistral3", "idefics3", "qwen2_5_vl", "janus"]  # (janus: its image generator has blocks)


def _families(rank, world, families):
    from automodel.api import load_config
    from automodel.distributed.init import DistInfo
    from automodel.recipes.train import build_setup

    warnings.simplefilter("ignore")
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    out = {}
    for sp in (False, True):
        cfg = load_config(TP2 + (SP if sp else []) + [
            "mesh.dp_size=1", "model=llava_tiny", "data=synthetic",
            "trainer.global_batch_size=4"])
        for family in families:
            run = _with_model(cfg, family)
            data = _batch(run)  # (4 rows, one image)
            setup = build_setup(run, info)
            one = dataclasses.replace(setup, strategy="none", mesh=None, cp=None)
            out[family, sp] = (_one_step(run, setup, data, slice(0, 4)),
                               _one_step(run, one, data, slice(0, 4)))
    return out


def test_more_families_take_one_step_like_one_process(tmp_path):
    ranks = run_on_ranks(_families, 2, MORE, tmp_path=tmp_path)
    for key, (tp, one) in ranks[0].items():
        assert ranks[1][key][0] == tp, key  # (one loss and norm on both TP ranks)
        assert tp == pytest.approx(one, rel=1e-5), key


def _seen(rank, world, sp):
    """Placements of the tower's and the language model's weights over TP, and what the
    tower's first block and the first language block receive in one step."""
    from torch.distributed.tensor import DTensor

    from automodel.recipes.step import train_step
    from tests.distributed.test_placement_effects import parallel_model

    cfg, setup, parallel = parallel_model(rank, world, ["mesh.tp_size=2", "mesh.dp_size=1",
                                                        "model=llava_tiny"] + (SP if sp else []))
    model = parallel.parts[0]
    placed = {  # the TP dim (the last of FSDP2 x TP) of a weight, or "whole"
        n.replace("_checkpoint_wrapped_module.", ""):
        (type(p.placements[-1]).__name__ if isinstance(p, DTensor)
         and p.device_mesh.mesh_dim_names[-1] == "tp" else "whole")
        for n, p in model.named_parameters()}
    inputs = {}

    def record(name):
        def hook(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            local = x.to_local() if isinstance(x, DTensor) else x
            inputs[name] = (type(x).__name__, tuple(x.shape), tuple(local.shape))
        return hook

    inner = model.model
    inner.language_model.layers[0].register_forward_pre_hook(record("language"),
                                                             with_kwargs=True)
    inner.vision_tower.encoder.layers[0].register_forward_pre_hook(
        record("tower"), with_kwargs=True)
    data = _batch(cfg)  # (4 rows, one image)
    train_step(model, setup, [data[slice(0, 4)].split()], None, head_loss=parallel.head_loss)
    return placed, inputs


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_the_tower_stays_whole_and_the_language_model_takes_sequence_shards(sp, tmp_path):
    (placed, inputs), (placed_1, inputs_1) = run_on_ranks(_seen, 2, sp, tmp_path=tmp_path)
    assert placed == placed_1 and inputs == inputs_1
    tower = {n: v for n, v in placed.items() if ".vision_tower." in n}
    assert tower and set(tower.values()) == {"whole"}  # (replicated over TP, not split)
    layer = "model.language_model.layers.0."
    assert placed[layer + "self_attn.q_proj.weight"] == "Shard"
    assert placed[layer + "mlp.down_proj.weight"] == "Shard"
    kind, whole, local = inputs["language"]
    assert inputs["tower"][1] == inputs["tower"][2]  # (the tower: whole images on each rank)
    if sp:  # each TP rank its half of the merged sequence, a DTensor of the full length
        assert kind == "DTensor" and local == (whole[0], whole[1] // 2, whole[2])
    else:
        assert kind == "Tensor" and local == whole


@pytest.mark.fast
@pytest.mark.parametrize("family,sp,expected", [
    ("paligemma", False, "must divide the model's num_key_value_heads=1 "
                         "(model.config.text_config.num_key_value_heads)"),
    ("glm5_next", False, "layers.0.self_attn (Glm5NextTextLinearAttention): the plan splits "
                         "its output projection by input ('rowwise') but none of its input "
                         "projections by output"),
    ("qwen3_vl", True, "layers.0.self_attn (Qwen3VLTextAttention) has no row-wise projection "
                       "in the plan"),
    ("step3p7", True, "layers.0.mlp (Step3p7MLP) has no row-wise projection in the plan"),
    ("qwen3_vl_moe", False, "uses style 'packed_colwise'"),
])
def test_what_a_family_s_plan_cannot_do_is_refused_before_launch(family, sp, expected):
    from automodel.api import load_config
    from automodel.config.build import ConfigError
    from automodel.launch.preflight import check_model_layout

    cfg = load_config(TP2 + (SP if sp else []) + ["mesh.dp_size=1", "model=llava_tiny",
                                                  "data=synthetic"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as info:
            check_model_layout(_with_model(cfg, family))
    assert expected in str(info.value)


@pytest.mark.fast
@pytest.mark.parametrize("layout", [["mesh.cp_size=2"], ["pipeline=1f1b"], ["mesh.ep_size=2"]])
def test_other_model_parallel_layouts_are_still_refused(layout):
    from automodel.api import load_config
    from automodel.config.build import ConfigError
    from automodel.launch.preflight import check_model_layout

    cfg = load_config(["parallelism=fsdp2", "model=llava_tiny", "data=synthetic"] + layout)
    with pytest.raises(ConfigError, match="context, pipeline and expert parallelism are not "
                                          "available for image-text models"):
        check_model_layout(cfg)
