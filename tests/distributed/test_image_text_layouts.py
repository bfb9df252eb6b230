"""Image-text models in every model-parallel layout: tensor parallelism (with and without
sequence parallelism), context parallelism, pipelines and expert parallelism.

- the three presets (LLaVA, Qwen2-VL, Gemma 3) with a trainable tower, one image every other
  sample and one sample per micro-batch, 4 a step (two without an image), 5 steps: losses
  and gradient norms match one process (fp32) under TP2, TP2+SP, CP2 (Gemma 3: refused
  under CP), 1F1B and interleaved pipelines (Qwen2-VL zero bubble, Gemma 3 the V schedule
  too); Qwen2-VL under TP2+SP x CP2, the three presets
  under PP2 x TP2+SP; the MoE preset (Qwen3-VL-MoE, router loss on) under EP2 and PP2; the
  default precision trains close to fp32 under TP2+SP, CP2, PP2 and EP2;
- four more families (Mistral 3, Idefics 3, Qwen2.5-VL, Janus), one step each, TP2, TP2+SP,
  CP2 and a 1F1B pipeline of two stages (GLM-5-Next too, its multi-stream residual passed
  between the stages);
- the effects: the tower's weights whole on every TP rank, the language model's split; under
  SP and CP the first language block takes its rank's part of the sequence, the tower and the
  merge the whole sequence; under a pipeline the first stage holds the tower and runs it in
  every micro-batch; under EP each rank holds half of the experts;
- a frozen tower (``model.freeze=[vision]``) under TP2, CP2 and PP2, each with another
  frozen-sharding policy (replicate, per_layer, root);
- what a family cannot do is refused before launch, naming the layer or the reason.
"""

import dataclasses
import warnings

import pytest
import torch

from tests.distributed.test_image_text_families import _batch as _any_batch
from tests.distributed.test_image_text_families import _one_step, _with_model
from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
from tests.helpers import FP32, run_on_ranks, train

TP2 = ["parallelism=fsdp2", FP32, "mesh.tp_size=2"]
SP = ["parallelism.sequence_parallel=true"]
CP2 = ["parallelism=fsdp2", FP32, "mesh.cp_size=2"]
# (one sample per pipeline micro-batch: with MIXED, half of them have no image)
PP2 = ["parallelism=fsdp2", FP32, "pipeline.pp_microbatch_size=1"]
LAYOUTS = {"tp2": TP2, "tp2_sp": TP2 + SP, "cp2": CP2, "pp2_1f1b": PP2 + ["pipeline=1f1b"],
           "pp2_interleaved": PP2 + ["pipeline=interleaved"],
           "ep2": ["parallelism=fsdp2", FP32, "mesh.ep_size=2"]}
HEADS = ["parallelism.multimodal.vision.tp=heads"]  # (the tower split by heads too)
VISION_TP = {"tp2_heads": TP2 + HEADS, "tp2_sp_heads": TP2 + SP + HEADS}
FOUR_RANKS = {  # (layouts of 4 ranks)
    "tp2_sp_cp2": TP2 + SP + ["mesh.cp_size=2", "distributed.nproc_per_node=4"],
    "pp2_tp2_sp": PP2 + ["pipeline=1f1b", "mesh.tp_size=2", "distributed.nproc_per_node=4"]
    + SP}
MIXED = ["data.image_every=2"]  # (one sample per micro-batch: half of them have no image)
FOUR = ["trainer.global_batch_size=4"]  # (4 micro-batches a step, 2 of them with an image)


def _batch(cfg):
    """The families' batch, its inputs a multiple of 8 tokens (2 * cp for up to cp 4)."""
    return _any_batch(cfg, multiple=8)


@pytest.mark.parametrize("preset,layout", [
    (preset, layout) for preset in ("llava_tiny", "qwen2_vl_tiny", "gemma3_vl_tiny")
    for layout in LAYOUTS if (preset, layout) != ("gemma3_vl_tiny", "cp2") and layout != "ep2"]
    + [("qwen2_vl_tiny", "tp2_sp_cp2"), ("llava_tiny", "pp2_tp2_sp"),
       ("qwen2_vl_tiny", "pp2_tp2_sp"), ("gemma3_vl_tiny", "pp2_tp2_sp"),
       ("gemma3_vl_tiny", "tp2_heads"), ("llava_tiny", "tp2_sp_heads"),
       ("qwen2_vl_tiny", "pp2_zero_bubble"),  # (backward split in input and weight parts)
       ("gemma3_vl_tiny", "pp2_v_schedule"),  # (rank 0 holds the first and the last stage)
       ("qwen3_vl_moe_tiny", "ep2"),  # (the router's loss on: placeholder rows left out)
       ("qwen3_vl_moe_tiny", "pp2_1f1b")])  # (its deepstack features: on the first stage)
def test_presets_match_one_process(preset, layout, reference, tmp_path):
    run = [f"model={preset}"] + MIXED + FOUR
    named = {**LAYOUTS, **FOUR_RANKS, **VISION_TP}
    over = named.get(layout) or PP2 + [f"pipeline={layout.removeprefix('pp2_')}"]
    records = train(over + ["trainer.local_batch_size=1"] + run, tmp_path)
    assert_matches(records, reference(*run))


@pytest.mark.parametrize("layout,preset", [("tp2_sp_heads", "llava_tiny"),
                                           ("cp2", "llava_tiny"), ("pp2_1f1b", "llava_tiny"),
                                           ("ep2", "qwen3_vl_moe_tiny")])
def test_the_default_precision_trains_close_to_fp32(layout, preset, reference, tmp_path):
    run = [f"model={preset}"] + MIXED
    over = {**LAYOUTS, **VISION_TP}[layout]
    records = train([o for o in over if o != FP32] + run, tmp_path)
    assert_close_to_fp32(records, reference(*run), loss_rtol=2e-2)


MORE = ["mistral3", "idefics3", "qwen2_5_vl", "janus"]  # (janus: its image generator has blocks)


def _families(rank, world, families):
    from automodel.api import load_config
    from automodel.distributed.init import DistInfo
    from automodel.recipes.train import build_setup

    warnings.simplefilter("ignore")
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    out, one = {}, {}
    for layout in ("tp2", "tp2_sp", "cp2", "pp2_1f1b"):
        cfg = load_config(LAYOUTS[layout] + ["mesh.dp_size=1", "model=llava_tiny",
                                             "data=synthetic", "trainer.global_batch_size=4"])
        # (GLM-5-Next: a residual of several streams, [batch, seq, streams, hidden], between
        # the stages)
        for family in families + (["glm5_next"] if layout == "pp2_1f1b" else []):
            run = _with_model(cfg, family)
            data = _batch(run)  # (4 rows, one image)
            setup = build_setup(run, info)
            if family not in one:  # (one process: the same step whatever the layout)
                alone = dataclasses.replace(setup, strategy="none", mesh=None, cp=None)
                one[family] = _one_step(run, alone, data, slice(0, 4))
            out[family, layout] = (_pipeline_step(run, setup, data) if setup.pp_enabled
                                   else _one_step(run, setup, data, slice(0, 4)), one[family])
    return out


def _pipeline_step(cfg, setup, data):
    """(loss, gradient norm) of one step of four pipeline micro-batches of one row each (three
    without an image: the tower runs on a blank one)."""
    from automodel.parallelize import parallelize
    from automodel.recipes.components import initial_model
    from automodel.recipes.pipeline_step import PipelineStep

    model, fill = initial_model(cfg, setup.dist)
    step = PipelineStep(parallelize(model, setup, fill), setup, 4)
    stats = step([data[i:i + 1].split(placeholder_row=False) for i in range(4)], None)
    return float(stats.loss), float(stats.grad_norm)


def test_more_families_take_one_step_like_one_process(tmp_path):
    ranks = run_on_ranks(_families, 2, MORE, tmp_path=tmp_path)
    for key, (tp, one) in ranks[0].items():
        assert ranks[1][key][0] == tp, key  # (one loss and norm on both ranks)
        assert tp == pytest.approx(one, rel=1e-5), key


FROZEN = {  # layout: (overrides, the frozen tower's sharding policy)
    "tp2": (["mesh.tp_size=2"], "replicate"), "cp2": (["mesh.cp_size=2"], "per_layer"),
    "pp2": (["pipeline=1f1b", "pipeline.pp_microbatch_size=1"], "root")}


def _frozen(rank, world):
    from automodel.api import load_config
    from automodel.distributed.init import DistInfo
    from automodel.recipes.train import build_setup

    warnings.simplefilter("ignore")
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
    out, one = {}, None
    for layout, (over, policy) in FROZEN.items():
        cfg = load_config(["parallelism=fsdp2", FP32, "mesh.dp_size=1", "model=llava_tiny",
                           "data=synthetic", "trainer.global_batch_size=4",
                           "model.freeze=[vision]",
                           f"parallelism.multimodal.frozen_sharding={policy}", *over])
        data = _batch(cfg)  # (4 rows, one image)
        setup = build_setup(cfg, info)
        if one is None:  # (one process, the tower frozen: the same step for every layout)
            alone = dataclasses.replace(setup, strategy="none", mesh=None, cp=None)
            one = _one_step(cfg, alone, data, slice(0, 4))
        out[layout] = (_pipeline_step(cfg, setup, data) if setup.pp_enabled
                       else _one_step(cfg, setup, data, slice(0, 4)))
    return out, one


def test_a_frozen_tower_under_each_sharding_policy_trains_like_one_process(tmp_path):
    (out, one), _ = run_on_ranks(_frozen, 2, tmp_path=tmp_path)
    for layout, got in out.items():
        assert got == pytest.approx(one, rel=1e-5), layout


SEEN = {"tp2": ["mesh.tp_size=2"], "tp2_sp": ["mesh.tp_size=2"] + SP, "cp2": ["mesh.cp_size=2"],
        "tp2_sp_heads": ["mesh.tp_size=2"] + SP + HEADS}


def _seen(rank, world, layout):
    """Placements of the tower's and the language model's weights over TP, what the tower's
    first block and the first language block receive in one step, and the positions the
    language model is handed."""
    from torch.distributed.tensor import DTensor

    from automodel.recipes.step import train_step
    from tests.distributed.test_placement_effects import parallel_model

    cfg, setup, parallel = parallel_model(rank, world, SEEN[layout] + ["mesh.dp_size=1",
                                                                       "model=llava_tiny"])
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
            if "position_ids" in kwargs:
                inputs[name + " positions"] = kwargs["position_ids"][0].tolist()
        return hook

    inner = model.model
    inner.language_model.layers[0].register_forward_pre_hook(record("language"),
                                                             with_kwargs=True)
    inner.vision_tower.encoder.layers[0].register_forward_pre_hook(
        record("tower"), with_kwargs=True)
    data = _batch(cfg)  # (4 rows, one image)
    train_step(model, setup, [data[slice(0, 4)].split()], None, head_loss=parallel.head_loss)
    return placed, inputs


@pytest.mark.parametrize("layout", SEEN)
def test_the_tower_stays_whole_and_the_language_model_takes_sequence_shards(layout, tmp_path):
    (placed, inputs), (placed_1, inputs_1) = run_on_ranks(_seen, 2, layout, tmp_path=tmp_path)
    tower = {n: v for n, v in placed.items() if ".vision_tower." in n}
    if layout == "tp2_sp_heads":  # (attention by heads, MLP by hidden size; norms whole)
        attention = "model.vision_tower.encoder.layers.0.self_attn."
        assert [tower[attention + k] for k in ("q_proj.weight", "out_proj.weight")] == \
            ["Shard", "Shard"] and "whole" in tower.values()
    else:
        assert tower and set(tower.values()) == {"whole"}  # (replicated over TP, not split)
    layer = "model.language_model.layers.0."
    split = "whole" if layout == "cp2" else "Shard"
    assert placed[layer + "self_attn.q_proj.weight"] == split
    assert placed[layer + "mlp.down_proj.weight"] == split
    kind, whole, local = inputs["language"]
    assert inputs["tower"][1] == inputs["tower"][2]  # (the tower: whole images on each rank)
    assert inputs["tower"] == inputs_1["tower"]
    if layout.startswith("tp2_sp"):  # each TP rank its half of the merged sequence
        assert kind == "DTensor" and local == (whole[0], whole[1] // 2, whole[2])
    elif layout == "cp2":  # each cp rank its two chunks (of four) of the merged sequence
        length = 2 * whole[1]
        chunk = length // 4
        assert kind == "Tensor" and inputs_1["language"] == inputs["language"]
        assert inputs["language positions"] == [*range(chunk), *range(3 * chunk, length)]
        assert inputs_1["language positions"] == [*range(chunk, 3 * chunk)]
    else:
        assert kind == "Tensor" and local == whole
    if layout != "cp2":
        assert placed == placed_1 and inputs == inputs_1


def _experts(rank, world):
    """This rank's share of the first MoE layer's experts under EP2, and its router loss."""
    from automodel.recipes.router_loss import RouterLoss
    from tests.distributed.test_placement_effects import parallel_model

    cfg, setup, parallel = parallel_model(rank, world, ["mesh.ep_size=2",
                                                        "model=qwen3_vl_moe_tiny"])
    experts = parallel.parts[0].model.language_model.layers[0].mlp.experts
    weight = experts.gate_up_proj
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return tuple(local.shape), float(local.sum()), RouterLoss.of(parallel.parts[0]) is not None


def test_each_ep_rank_holds_half_of_the_experts(tmp_path):
    (shape_0, sum_0, router), (shape_1, sum_1, _) = run_on_ranks(_experts, 2, tmp_path=tmp_path)
    assert shape_0[0] == shape_1[0] == 2  # (4 experts over 2 ranks, each whole on its rank)
    assert sum_0 != sum_1 and router  # (different experts; the router loss read from text_config)


TOWER_FIRST = ("pipeline.module_fqns_per_model_part=[[model.vision_tower,"
               "model.multi_modal_projector,model.language_model.embed_tokens,"
               "model.language_model.layers.0],[model.language_model.layers.1,"
               "model.language_model.layers.2,model.language_model.layers.3,"
               "model.language_model.norm,lm_head]]")


def _stages(rank, world):
    """Under a two-stage pipeline with the tower and one layer on stage 0: the parameter
    names this rank's stage holds, the tower's runs and what the first layer of the stage
    receives, in one step of four micro-batches (one with an image)."""
    from automodel.recipes.pipeline_step import PipelineStep
    from tests.distributed.test_placement_effects import parallel_model

    cfg, setup, parallel = parallel_model(rank, world, [
        "mesh.dp_size=1", "model=llava_tiny", "pipeline=1f1b", "pipeline.pp_microbatch_size=1",
        TOWER_FIRST])
    part = parallel.parts[0]
    names = [n.replace("_checkpoint_wrapped_module.", "") for n, _ in part.named_parameters()]
    seen = {"tower": 0, "layer": []}
    inner = part.model
    if inner.vision_tower is not None:
        inner.vision_tower.register_forward_hook(
            lambda *_: seen.__setitem__("tower", seen["tower"] + 1))
    layers = inner.language_model.layers
    first = layers[layers.first]
    first.register_forward_pre_hook(
        lambda m, args, kw: seen["layer"].append(tuple(kw.get("hidden_states", args[0] if args
                                                              else None).shape)),
        with_kwargs=True)
    data = _batch(cfg)  # (4 rows, one image)
    PipelineStep(parallel, setup, 4)([data[i:i + 1].split(placeholder_row=False)
                                      for i in range(4)], None)
    return names, seen, len(data.has_image.nonzero())


def test_the_first_stage_holds_the_tower_and_runs_it_in_every_micro_batch(tmp_path):
    (names_0, seen_0, images), (names_1, seen_1, _) = run_on_ranks(_stages, 2,
                                                                   tmp_path=tmp_path)
    tower = [n for n in names_0 if n.startswith("model.vision_tower.")]
    assert tower and any(n.startswith("model.multi_modal_projector.") for n in names_0)
    assert not any(n.startswith(("model.vision_tower.", "model.multi_modal_projector."))
                   for n in names_1)
    def language_layers(names):
        return sorted({n.split(".")[3] for n in names
                       if n.startswith("model.language_model.layers.")})

    assert language_layers(names_0) == ["0"] and language_layers(names_1) == ["1", "2", "3"]
    assert images == 1  # (three micro-batches without an image: the tower runs on a blank)
    assert seen_0["tower"] >= 4 and seen_1["tower"] == 0
    whole = seen_0["layer"][-1]
    assert whole[0] == 1 and seen_1["layer"][-1] == whole  # (hidden states, whole sequence)


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
])
def test_what_a_family_s_plan_cannot_do_is_refused_before_launch(family, sp, expected):
    assert expected in _refusal(family, TP2 + (SP if sp else []))


def _refusal(family: str, layout: list) -> str:
    """The preflight's refusal of ``family`` (tiny) in ``layout`` (it must refuse)."""
    from automodel.api import load_config
    from automodel.checks.preflight import check_model_layout
    from automodel.config.build import ConfigError

    cfg = load_config(layout + ["mesh.dp_size=1", "model=llava_tiny", "data=synthetic"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as info:
            check_model_layout(_with_model(cfg, family))
    return str(info.value)


@pytest.mark.fast
@pytest.mark.parametrize("family,tp,expected", [
    ("qwen2_vl", 2, "model.visual.blocks.0.attn.qkv (32 -> 96) is neither an input projection"),
    ("llava", 4, "mesh.tp_size=4 must divide the tower's attention heads (2, vision_config"),
])
def test_a_tower_that_cannot_split_by_heads_is_refused_before_launch(family, tp, expected):
    assert expected in _refusal(family, ["parallelism=fsdp2", f"mesh.tp_size={tp}",
                                         f"distributed.nproc_per_node={tp}"] + HEADS)


@pytest.mark.fast
@pytest.mark.parametrize("family,expected", [
    ("gemma3", "lets its image tokens attend to each other both ways (it takes "
               "token_type_ids)"),
    ("qwen3_vl", "adds image features inside its language layers at image positions of the "
                 "whole sequence (deepstack)"),
    ("qwen3_5", "has layers of type linear_attention (layer_types)"),
    ("lfm3_vl", "has layers of type conv (layer_types)"),
    ("mistral_large4", "has layers of type indexed_attention (layer_types)"),
    ("got_ocr2", "does not run its attention through transformers' attention interface"),
])
def test_what_a_family_cannot_split_over_cp_ranks_is_refused_before_launch(family, expected):
    why = _refusal(family, CP2)
    assert "mesh.cp_size=2" in why and expected in why


@pytest.mark.fast
def test_a_sequence_that_does_not_split_into_cp_chunks_is_refused():
    from automodel.distributed.context_parallel import ContextParallel
    from automodel.distributed.tp_image_text import split_sequence_on_entry

    class Stack(torch.nn.Module):
        def forward(self, inputs_embeds=None, position_ids=None):
            return inputs_embeds, position_ids

    stack = Stack()
    split_sequence_on_entry(stack, ContextParallel(ring_size=2, ulysses_size=1, ring_rank=0,
                                                   ulysses_rank=0))
    embeds, positions = stack(inputs_embeds=torch.arange(8.0).reshape(1, 8, 1))
    assert embeds.flatten().tolist() == [0, 1, 6, 7] and positions.tolist() == [[0, 1, 6, 7]]
    with pytest.raises(ValueError, match="received a sequence of 9 tokens, which does not "
                                         "split into 2 \\* cp_size = 4 equal chunks"):
        stack(inputs_embeds=torch.ones(1, 9, 1))


@pytest.mark.fast
@pytest.mark.parametrize("layout,expected", [
    (["mesh.ep_size=2"], "LlavaForConditionalGeneration (model_type 'llava') has no experts "
                         "modules"),
    (["pipeline=1f1b", "mesh.cp_size=2", "distributed.nproc_per_node=4"],
     "a pipeline with context parallelism (mesh.pp_size=2, mesh.cp_size=2) is not available"),
])
def test_layouts_an_image_text_model_cannot_take_are_refused(layout, expected):
    from automodel.api import load_config
    from automodel.checks.preflight import check_model_layout
    from automodel.config.build import ConfigError

    cfg = load_config(["parallelism=fsdp2", "model=llava_tiny", "data=synthetic"] + layout)
    with pytest.raises(ConfigError) as info:
        check_model_layout(cfg)
    assert expected in str(info.value)
