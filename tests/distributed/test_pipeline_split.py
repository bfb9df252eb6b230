"""Stage split and placement rules (no processes needed)."""

import pytest
import torch

from automodel.config.pipeline_layout import count_stages, stage_layer_ranges
from automodel.config.schema import ModelConfig
from automodel.distributed.pipelining.loop_form import loop_output_form
from automodel.distributed.pipelining.schedule import schedule_spec, stages_of_rank
from automodel.distributed.pipelining.split import (
    StageContents,
    StageLayers,
    build_stage,
    contents_from_fqns,
)
from automodel.models.anatomy import find_anatomy
from automodel.models.builder import build_model

# fast: no process, no process group (pytest -m fast)
pytestmark = pytest.mark.fast


def test_even_split_gives_the_remainder_to_the_first_stages():
    assert [list(r) for r in stage_layer_ranges(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(r) for r in stage_layer_ranges(4, 2, layers_per_stage=2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="at least as many layers"):
        stage_layer_ranges(2, 3)


def test_virtual_stage_counts_and_rounding():
    assert count_stages(8, 2, multi_stage=False, v_placement=False, layers_per_stage=None,
                        rounding=None) == 2
    assert count_stages(8, 2, True, False, None, None) == 4
    assert count_stages(8, 2, True, True, 1, None) == 4  # V: always two per rank
    assert count_stages(9, 2, True, False, 3, "up") == 4
    assert count_stages(9, 2, True, False, 3, "down") == 2
    with pytest.raises(ValueError, match="round_virtual_stages_to_pp_multiple"):
        count_stages(9, 2, True, False, 3, None)


def test_loop_and_v_placement():
    assert stages_of_rank(0, 2, 4, v_placement=False) == [0, 2]
    assert stages_of_rank(1, 2, 4, v_placement=False) == [1, 3]
    assert stages_of_rank(0, 2, 4, v_placement=True) == [0, 3]
    assert stages_of_rank(1, 2, 4, v_placement=True) == [1, 2]
    assert schedule_spec("ZBVZeroBubble").v_placement
    with pytest.raises(ValueError, match="allowed"):
        schedule_spec("zigzag")
    assert schedule_spec("DualPipeV").v_placement and schedule_spec("GPIPE").cls.__name__ == \
        "ScheduleGPipe"


def test_stages_keep_original_names_and_compose_to_the_model():
    cfg = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                              "intermediate_size": 64, "num_hidden_layers": 4,
                              "num_attention_heads": 2, "num_key_value_heads": 2})
    model = build_model(cfg, seed=0)
    anatomy = find_anatomy(model)
    first = build_stage(model, anatomy, StageContents([0, 1, 2], embed=True, head=False))
    last = build_stage(model, anatomy, StageContents([3], embed=False, head=True))
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(model.state_dict())  # every parameter on exactly one stage, same name
    assert not set(first.state_dict()) & set(last.state_dict())
    assert "model.layers.3.mlp.up_proj.weight" in last.state_dict()
    ids = torch.randint(0, 64, (2, 8))
    hidden = first(ids)
    assert hidden._base is None  # a fresh tensor, never a view of the input
    expected = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(last(hidden), expected)


FAMILY_SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("model_type,extra", [
    ("gpt_neox", {}),  # embed_in / final_layer_norm, parallel residual
    ("phi", {}),  # final_layernorm, embedding dropout in its pipeline plan
    ("gemma", {"head_dim": 8}),  # tied, scaled embedding
    ("gemma2", {"head_dim": 8, "sliding_window": 3}),  # layer types chosen by layer index
    ("granite", {"embedding_multiplier": 3.0, "logits_scaling": 2.0}),  # multiplier in forward
    ("gptj", {"rotary_dim": 4}),  # wte / h / ln_f
    ("stablelm", {}),  # no base_model_pp_plan: found by search
    # layers return (hidden, attention weights), the loop unpacks two: the stages after the
    # first pass the earlier stages' layers as pairs before their own layer has run
    ("bamba", {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1,
               "mamba_chunk_size": 4, "attn_layer_indices": [1]}),
])
def test_three_stages_compose_to_the_model_for_other_families(model_type, extra):
    model = build_model(ModelConfig(config={"model_type": model_type, **FAMILY_SIZES, **extra}),
                        seed=0)
    anatomy = find_anatomy(model)
    stages = [build_stage(model, anatomy, c) for c in (
        StageContents([0], embed=True, head=False), StageContents([1, 2], False, False),
        StageContents([3], embed=False, head=True))]
    for batch in (1, 3):  # (a tensor of two samples would unpack as a pair)
        ids = torch.randint(0, 64, (batch, 12))
        x = ids
        for stage in stages:
            x = stage(x)
        torch.testing.assert_close(x, model(input_ids=ids, use_cache=False).logits)
    full = set(model.state_dict())
    names = [set(s.state_dict()) for s in stages]
    assert set().union(*names) == full
    if model.config.tie_word_embeddings:  # the last stage holds the shared weight by its name
        embed = f"{anatomy.base}.{anatomy.embed}.weight"
        assert embed in names[0] and embed in names[2] and embed not in names[1]
        last = stages[2]
        assert last.get_output_embeddings().weight is last.get_input_embeddings().weight
    else:
        assert not names[0] & names[1] and not names[1] & names[2]
    assert isinstance(getattr(getattr(stages[1], anatomy.base), anatomy.layers), StageLayers)


def test_module_fqns_per_model_part():
    cfg = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                              "intermediate_size": 64, "num_hidden_layers": 4,
                              "num_attention_heads": 2, "num_key_value_heads": 2})
    model = build_model(cfg, seed=0)
    parts = [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.layers.2"],
             ["model.layers.3", "model.norm", "lm_head"]]
    anatomy = find_anatomy(model)
    contents = contents_from_fqns(model, anatomy, parts)
    assert [c.layers for c in contents] == [[0], [1, 2], [3]]
    assert [(c.embed, c.head) for c in contents] == [(True, False), (False, False), (False, True)]
    with pytest.raises(ValueError, match="'model.layers.9'"):
        contents_from_fqns(model, anatomy, [["model.embed_tokens", "model.layers.9"]])
    with pytest.raises(ValueError, match="every decoder layer exactly once"):
        contents_from_fqns(model, anatomy, [["model.embed_tokens", "model.layers.0"],
                                   ["model.layers.2", "model.norm", "lm_head"]])
    with pytest.raises(ValueError, match="belong to the last part"):
        contents_from_fqns(model, anatomy, [["model.embed_tokens", "model.layers.0",
                                    "model.layers.1",
                                    "lm_head"], ["model.layers.2", "model.layers.3"]])


def test_forward_patches_can_be_turned_off():
    cfg = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                              "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2})
    model = build_model(cfg, seed=0)
    anatomy = find_anatomy(model)
    stage = build_stage(model, anatomy, StageContents([0, 1], embed=True, head=True),
                        patch_inner=False, patch_causal_lm=False)
    assert "forward" not in vars(stage)  # the model's own forward
    assert not isinstance(stage.model.layers, StageLayers)
    patched = build_stage(model, anatomy, StageContents([0, 1], embed=True, head=True))
    assert "forward" in vars(patched) and isinstance(patched.model.layers, StageLayers)


class _Pairs:
    def forward(self, x):
        for i, layer in enumerate(self.layers[: self.n]):
            x, attn = layer(x, i)
        return x


class _Indexed:
    def forward(self, x):
        for block in self.h:
            out = block(x)
            x = out[0]
            if self.keep:
                self.kept.append(out[2])
        return x


class _Plain:
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Elsewhere:
    def forward(self, x):
        return self.run(x)


def test_the_loop_shows_what_a_passed_layer_returns():
    assert loop_output_form(_Pairs, "layers") == (True, (tuple, 2))
    assert loop_output_form(_Indexed, "h") == (True, (tuple, 3))  # (index 2 read)
    assert loop_output_form(_Plain, "layers") == (True, None)
    assert loop_output_form(_Plain, "blocks") == (False, None)
    assert loop_output_form(_Elsewhere, "layers") == (False, None)
