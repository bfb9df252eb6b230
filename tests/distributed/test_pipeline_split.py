"""Stage split and placement rules (no processes needed)."""

import pytest
import torch

from automodel.config.schema import ModelConfig
from automodel.distributed.pipelining.schedule import schedule_spec, stages_of_rank
from automodel.distributed.pipelining.layout import count_stages, stage_layer_ranges
from automodel.distributed.pipelining.split import StageContents, build_stage, contents_from_fqns
from automodel.models.builder import build_model


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
    first = build_stage(model, StageContents([0, 1, 2], embed=True, head=False))
    last = build_stage(model, StageContents([3], embed=False, head=True))
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(model.state_dict())  # every parameter on exactly one stage, same name
    assert "model.layers.3.mlp.up_proj.weight" in last.state_dict()
    ids = torch.randint(0, 64, (2, 8))
    hidden = first(ids)
    assert hidden._base is None  # a fresh tensor, never a view of the input
    expected = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(last(hidden), expected)


def test_module_fqns_per_model_part():
    cfg = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                              "intermediate_size": 64, "num_hidden_layers": 4,
                              "num_attention_heads": 2, "num_key_value_heads": 2})
    model = build_model(cfg, seed=0)
    parts = [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.layers.2"],
             ["model.layers.3", "model.norm", "lm_head"]]
    contents = contents_from_fqns(model, parts)
    assert [c.layers for c in contents] == [[0], [1, 2], [3]]
    assert [(c.embed, c.head) for c in contents] == [(True, False), (False, False), (False, True)]
    with pytest.raises(ValueError, match="'model.layers.9'"):
        contents_from_fqns(model, [["model.embed_tokens", "model.layers.9"]])
    with pytest.raises(ValueError, match="every decoder layer exactly once"):
        contents_from_fqns(model, [["model.embed_tokens", "model.layers.0"],
                                   ["model.layers.2", "model.norm", "lm_head"]])
    with pytest.raises(ValueError, match="belong to the last part"):
        contents_from_fqns(model, [["model.embed_tokens", "model.layers.0", "model.layers.1",
                                    "lm_head"], ["model.layers.2", "model.layers.3"]])


def test_forward_patches_can_be_turned_off():
    cfg = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                              "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2})
    model = build_model(cfg, seed=0)
    stage = build_stage(model, StageContents([0, 1], embed=True, head=True),
                        patch_inner=False, patch_causal_lm=False)
    assert "forward" not in vars(stage) and "forward" not in vars(stage.model)  # the model's own
    patched = build_stage(model, StageContents([0, 1], embed=True, head=True))
    assert "forward" in vars(patched) and "forward" in vars(patched.model)
