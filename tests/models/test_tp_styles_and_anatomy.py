"""The TP style table against the installed transformers (whatever its version in the pinned
range: every style translated or refused before launch by name), every family's plan and
pipeline anatomy, and the checks that refuse a layout before launch (meta-device models: no
weights, no processes)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from automodel.api import load_config
from automodel.checks.preflight import check_model_layout
from automodel.config.build import ConfigError
from automodel.config.tp_styles import TP_STYLE_NAMES, TP_STYLES, style_problem
from automodel.models.anatomy import AnatomyError, find_anatomy

pytestmark = pytest.mark.fast

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)


def _installed_styles() -> set[str]:
    import transformers.distributed.expert_parallel  # noqa: F401  (they register their styles
    import transformers.distributed.tensor_parallel  # noqa: F401   in the table on import)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return set(ALL_PARALLEL_STYLES)


def test_every_style_is_translated_or_refused_before_launch_by_name():
    """Every style automodel lists is translated or refused with its reason; a style it does
    not list (a newer transformers' within the pinned range: 5.25 added ``unit_colwise``) is
    refused as unknown, naming it, before launch. The rule holds for any installed version:
    it is checked on the installed table, and on a style no version has."""
    for name, info in TP_STYLES.items():
        assert (style_problem(name) is None) == (name in TP_STYLE_NAMES) == (info.refused is None)
    unknown = sorted(_installed_styles() - set(TP_STYLES)) + ["rowwize"]
    for style in unknown:
        assert "is not a known tensor-parallel style" in style_problem(style)
        with pytest.raises(ConfigError, match=f"uses style '{style}', which is not a known"):
            load_config(["mesh.tp_size=2", "parallelism.tp_plan={model.layers.*.mlp.gate_proj:"
                         f"{style}}}"])
    assert len(_installed_styles() & set(TP_STYLE_NAMES)) > 10  # (the common ones: translated)


def _family_plans():
    for model_type, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if model_type not in CONFIG_MAPPING:
            continue
        plan = dict(CONFIG_MAPPING[model_type].base_model_tp_plan or {})
        import transformers

        cls = getattr(transformers, cls_name, None)
        plan.update(getattr(cls, "_tp_plan", None) or {})
        if plan:
            yield model_type, plan


def test_every_family_plan_runs_or_is_refused_before_launch_naming_its_style():
    """Families whose plans use only styles automodel translates run; a family whose plan
    uses a style automodel refuses or does not know (a newer transformers' family) is refused
    under TP before launch, naming the style."""
    families = dict(_family_plans())
    assert len(families) > 100
    runnable = [m for m, plan in families.items() if all(style_problem(s) is None
                                                         for s in plan.values())]
    for model_type in ("llama", "gpt_neox", "phi", "phi3", "olmo2", "gemma", "gemma2", "glm",
                       "granite", "starcoder2", "minicpm3", "granite_swa"):
        assert model_type in runnable
    new = sorted(m for m, plan in families.items() if set(plan.values()) - set(TP_STYLES))
    for model_type in new[:3]:  # (none on the tested transformers; 5.25: minicpm5_moe)
        refused = "|".join(s for s in set(families[model_type].values()) if style_problem(s))
        with pytest.raises(ConfigError, match=f"uses style '({refused})', which"):
            check_model_layout(load_config(["data=synthetic", "mesh.tp_size=2",
                                            f"model.config.model_type={model_type}"]))


def _meta(model_type, **kwargs):
    config = AutoConfig.for_model(model_type, **{**SMALL, **kwargs})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type,expected", [
    ("llama", ("model", "embed_tokens", "layers", (), ("norm",), "lm_head",
               "base_model_pp_plan")),
    ("gpt_neox", ("gpt_neox", "embed_in", "layers", (), ("final_layer_norm",), "lm_head",
                  "base_model_pp_plan")),
    ("phi", ("model", "embed_tokens", "layers", (), ("final_layernorm",), "lm_head",
             "base_model_pp_plan")),
    ("gptj", ("transformer", "wte", "h", (), ("ln_f",), "lm_head", "base_model_pp_plan")),
    ("stablelm", ("model", "embed_tokens", "layers", (), ("norm",), "lm_head", "forward")),
    # learned positions run before the blocks: they go to the first stage
    ("gpt2", ("transformer", "wte", "h", ("wpe",), ("ln_f",), "lm_head", "forward")),
    # BLOOM's embedding norm, before the blocks
    ("bloom", ("transformer", "word_embeddings", "h", ("word_embeddings_layernorm",),
               ("ln_f",), "lm_head", "forward")),
    # the layers one level down (model.decoder), with learned positions and a final norm
    ("opt", ("model.decoder", "embed_tokens", "layers", ("embed_positions",),
             ("final_layer_norm",), "lm_head", "forward")),
])
def test_anatomy_from_the_pp_plan_or_the_forward(model_type, expected):
    a = find_anatomy(_meta(model_type))
    assert (a.stack, a.embed, a.layers, a.before, a.after, a.head, a.source) == expected
    assert a.num_layers == 4


def test_anatomy_refuses_parts_it_cannot_place():
    model = _meta("llama")
    model.model.extra = torch.nn.Linear(4, 4, device="meta")  # never run by the forward
    with pytest.raises(AnatomyError, match="model.extra hold parameters but run neither"):
        find_anatomy(model)
    model = _meta("llama")
    model.side = torch.nn.Linear(4, 4, device="meta")  # beside the base model and the head
    with pytest.raises(AnatomyError, match=r"\(causal LM\) side"):
        find_anatomy(model)


def error(*overrides):
    cfg = load_config(["data=synthetic"] + list(overrides))
    with pytest.raises(ConfigError) as info:
        check_model_layout(cfg)
    return str(info.value)


def test_refusals_name_the_family_pattern_and_style():
    # a MoE family's own plan runs without its expert entries (tests/distributed/test_moe.py);
    # a plan that asks for tensor-parallel experts is refused, naming the style
    with pytest.raises(ConfigError, match="'moe_tp_experts', which tensor-parallel expert"):
        load_config(["mesh.tp_size=2", "model=qwen3_moe_tiny",
                     "parallelism.tp_plan={model.layers.*.mlp.experts:moe_tp_experts}"])
    # no plan of its own, and not Llama's module names
    msg = error("mesh.tp_size=2", "model.config.model_type=gpt2")
    assert "GPT2LMHeadModel" in msg and "matches no module" in msg


def test_plan_rules_use_the_model_itself():
    # an MLP-only plan leaves the vocabulary whole: any vocab size works
    check_model_layout(load_config([
        "mesh.tp_size=2", "model.config.vocab_size=257",
        "parallelism.tp_plan={model.layers.*.mlp.up_proj:colwise,"
        "model.layers.*.mlp.gate_proj:colwise,model.layers.*.mlp.down_proj:rowwise}"]))
    assert "vocab_size=257" in error("mesh.tp_size=2", "model.config.vocab_size=257")
    assert "num_key_value_heads=2" in error("mesh.tp_size=4")
    assert "num_attention_heads=4" in error("mesh.tp_size=8")
    # OLMo 2's plan gathers q/k/v: its heads need not divide tp_size
    check_model_layout(load_config(["mesh.tp_size=2", "model=olmo2_tiny",
                                    "model.config.num_key_value_heads=1"]))


def test_explicit_stage_parts_use_the_family_names():
    parts = ("pipeline.module_fqns_per_model_part=[[gpt_neox.embed_in,gpt_neox.layers.0],"
             "[gpt_neox.layers.1,gpt_neox.layers.2,gpt_neox.layers.3,gpt_neox.final_layer_norm,"
             "lm_head]]")
    check_model_layout(load_config(["pipeline=1f1b", "model=gpt_neox_tiny", parts]))
    msg = error("pipeline=1f1b", "model=gpt_neox_tiny", parts.replace("embed_in", "embed_tokens"))
    assert "gpt_neox.embed_tokens" in msg and "gpt_neox.embed_in" in msg


def test_attention_that_reshapes_with_its_own_head_counts_gets_the_local_ones():
    from automodel.distributed.tensor_parallel import expand_plan, head_split_modules
    from automodel.distributed.tp_heads import localize_head_counts
    from automodel.models.tp_plans import select_tp_plan

    # StableLM (no plan of its own: the Llama-style fallback) views q with self.num_heads
    model = _meta("stablelm")
    concrete = expand_plan(model, *select_tp_plan(model, None))
    attention = head_split_modules(concrete)
    assert attention == [f"model.layers.{i}.self_attn" for i in range(4)]
    changed = localize_head_counts(model, attention, 2)
    assert changed["model.layers.0.self_attn"] == {"num_heads": (4, 2),
                                                   "num_key_value_heads": (2, 1)}
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_key_value_heads, attn.num_key_value_groups,
            attn.head_dim, attn.hidden_size) == (2, 1, 2, 16, 64)  # hidden_size unread
    # Llama reshapes with -1: nothing to change
    model = _meta("llama")
    concrete = expand_plan(model, *select_tp_plan(model, None))
    assert localize_head_counts(model, head_split_modules(concrete), 2) == {}


@pytest.mark.parametrize("model_type,before,after", [
    ("gpt2", "transformer.wpe", "transformer.ln_f"),
    ("opt", "model.decoder.embed_positions", "model.decoder.final_layer_norm"),
])
def test_the_first_and_last_stages_take_the_modules_around_the_blocks(model_type, before,
                                                                       after):
    from automodel.distributed.pipelining.split import StandIn, build_stage, even_contents

    model = _meta(model_type)
    anatomy = find_anatomy(model)
    first, last = (build_stage(model, anatomy, c) for c in even_contents(4, 2, None))
    names = [{n for n, _ in part.named_parameters()} for part in (first, last)]
    assert any(n.startswith(before + ".") for n in names[0])
    assert not any(n.startswith(before + ".") for n in names[1])
    assert isinstance(last.get_submodule(before), StandIn)  # no parameters, same shape out
    assert any(n.startswith(after + ".") for n in names[1])
    assert not any(n.startswith(after + ".") for n in names[0])
    assert isinstance(first.get_submodule(after), torch.nn.Identity)
    # every parameter of the model is on one stage or the other (the tied head on both)
    assert names[0] | names[1] == {n for n, _ in model.named_parameters()}
    if model_type == "opt":  # a stand-in gives the shape the module gives, in zeros
        mask = torch.ones(2, 8, dtype=torch.long)
        out = last.get_submodule(before)(mask, 0, position_ids=None)
        assert out.shape == (2, 8, 64) and not out.any() and out.device.type == "cpu"


def test_activations_with_weights_beside_a_split_projection_are_found():
    from automodel.distributed.tensor_parallel import activations_with_weights, expand_plan
    from automodel.models.tp_plans import select_tp_plan

    model = _meta("apertus")  # xIELU has trainable alpha_p, alpha_n; its plan leaves it out
    concrete = expand_plan(model, *select_tp_plan(model, None))
    assert activations_with_weights(model, concrete) == [
        f"model.layers.{i}.mlp.act_fn" for i in range(4)]
    model = _meta("llama")  # SiLU has no weights
    assert activations_with_weights(model, expand_plan(model, *select_tp_plan(model, None))) == []


def test_per_head_weights_left_out_of_a_plan_are_found():
    from automodel.distributed.tensor_parallel import expand_plan, per_head_weights
    from automodel.models.tp_plans import select_tp_plan

    # GLM-4-MoE's plan splits q/k/v by heads but leaves its per-head q/k norms out
    model = _meta("glm4_moe", use_qk_norm=True, head_dim=16, moe_intermediate_size=32,
                  n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)
    concrete = expand_plan(model, *select_tp_plan(model, None))
    assert per_head_weights(model, concrete) == [
        f"model.layers.{i}.self_attn.{n}" for i in range(4) for n in ("q_norm", "k_norm")]
    model = _meta("qwen3")  # Qwen3's plan names its norms itself
    assert per_head_weights(model, expand_plan(model, *select_tp_plan(model, None))) == []
