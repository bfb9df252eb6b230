"""LoRA on the model, in this process: where adapters go, what they compute, what trains, and
the refusals before launch (``automodel/peft``, ``config/validate_peft.py``)."""

import dataclasses

import pytest
import torch

from automodel.api import load_config
from automodel.checks.preflight import preflight
from automodel.config.build import ConfigError
from automodel.config.enums import LoraInit, PeftMethod
from automodel.config.schema import ModelConfig, PeftConfig
from automodel.models.builder import build_meta_model, build_model
from automodel.peft import add_adapters, init_adapters
from automodel.peft.lora import LoraLinear, initial_a, lora_modules

pytestmark = pytest.mark.fast

LORA = PeftConfig(method=PeftMethod.lora, rank=4, alpha=8.0)
LLAMA = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                            "intermediate_size": 48, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2})
PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def _adapted(peft=LORA, seed=0, cfg=LLAMA):
    model = build_model(cfg, seed=seed)
    names = add_adapters(model, peft)
    init_adapters([model], peft, seed)
    return model, names


def test_adapters_sit_beside_the_weights_under_the_base_names():
    base = build_model(LLAMA, seed=0)
    model, names = _adapted()
    # the default: the attention and MLP projections of every block, never the LM head
    assert names == [f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS]
    base_names = set(base.state_dict())
    names_now = set(model.state_dict())
    assert base_names <= names_now  # every base weight where it was
    assert names_now - base_names == {f"{n}.lora_{ab}.weight" for n in names for ab in "AB"}
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoraLinear) and q.lora_A.weight.shape == (4, 32)
    assert q.lora_B.weight.shape == (32, 4) and q.scaling == 2.0
    assert {n for n, p in model.named_parameters() if p.requires_grad} == names_now - base_names
    ids = torch.randint(0, 64, (2, 8))  # B starts at zero: the adapted model is the base
    torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits,
                               rtol=0, atol=0)


def test_an_adapted_layer_computes_the_low_rank_update():
    model, _ = _adapted(dataclasses.replace(LORA, lora_dtype="float64"))
    layer = model.model.layers[1].mlp.down_proj
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 48)
    a, b = layer.lora_A.weight, layer.lora_B.weight
    expected = x @ layer.weight.T + (2.0 * (x.double() @ a.T @ b.T)).float()
    torch.testing.assert_close(layer(x), expected)
    assert a.dtype == torch.float64 and layer(x).dtype == torch.float32  # (peft.lora_dtype)


def test_only_the_adapters_train():
    model, _ = _adapted()
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.1)  # (so that A gets a gradient too)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=0.01)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for name, p in model.named_parameters():
        moved = not torch.equal(before[name], p)
        assert moved == (".lora_" in name), name


def test_the_first_values_are_the_module_s_own_whatever_the_build():
    one, _ = _adapted(seed=3)
    meta = build_meta_model(LLAMA)  # the ranks' path: adapters on meta, allocated, then filled
    add_adapters(meta, LORA)
    assert meta.model.layers[0].self_attn.q_proj.lora_A.weight.is_meta
    meta.to_empty(device="cpu")
    init_adapters([meta], LORA, seed=3)
    for name, m in lora_modules(one).items():
        other = meta.get_submodule(name)
        assert torch.equal(m.lora_A.weight, other.lora_A.weight)
        assert not m.lora_B.weight.any()
    a = one.model.layers[0].self_attn.q_proj.lora_A.weight
    assert a.abs().max() <= 32 ** -0.5  # kaiming: within 1/sqrt(in)
    other_seed, _ = _adapted(seed=4)
    assert not torch.equal(a, other_seed.model.layers[0].self_attn.q_proj.lora_A.weight)
    gauss = initial_a("x", (64, 1000), 0, str(LoraInit.gaussian))
    assert abs(gauss.std().item() - 1 / 64) < 1e-3


def test_patterns_all_linear_and_exclusions():
    _, names = _adapted(dataclasses.replace(LORA, target_modules=["*.q_proj", "v_proj"]))
    assert names == [f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "v_proj")
                     for i in range(2)]
    _, names = _adapted(dataclasses.replace(LORA, target_modules=["all-linear"],
                                            exclude_modules=["*.mlp.*"]))
    assert len(names) == 8 and "lm_head" not in names and not any(".mlp." in n for n in names)


def test_moe_routers_and_gates_take_no_adapters_by_default(caplog):
    qwen2_moe = ModelConfig(config={**LLAMA.config, "model_type": "qwen2_moe", "num_experts": 4,
                                    "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                    "shared_expert_intermediate_size": 16})
    with caplog.at_level("WARNING", logger="automodel.peft"):
        _, names = _adapted(cfg=qwen2_moe)
    layer0 = [n.split(".", 3)[3] for n in names if n.startswith("model.layers.0.")]
    # the shared expert's projections, not the router nor the shared expert's 1-wide gate
    assert layer0 == PROJECTIONS[:4] + [f"mlp.shared_expert.{p}"
                                        for p in ("gate_proj", "up_proj", "down_proj")]
    assert "experts of 2 MoE layers take no adapters" in caplog.text  # (said, not silent)


@pytest.mark.parametrize("peft,expected", [
    (dict(target_modules=["*.q_porj"]), "'*.q_porj' matches no linear layer of "
                                        "LlamaForCausalLM; nearest names: q_proj"),
    (dict(target_modules=["*.embed_tokens"]), "matches model.embed_tokens (Embedding), not "
                                              "a linear layer"),
    (dict(rank=20), "peft.rank=20 is wider than model.layers.0.self_attn.k_proj (32 -> 16): "
                    "at most 16"),
    (dict(target_modules=["all-linear"], exclude_modules=["*.q_prj"]),
     "peft.exclude_modules: '*.q_prj' takes out none"),
    (dict(target_modules=["lm_head"]), "the fused loss (trainer.loss=auto or fused)"),
])
def test_what_the_model_cannot_take_is_refused_naming_it(peft, expected):
    with pytest.raises(ValueError) as info:
        add_adapters(build_meta_model(LLAMA), dataclasses.replace(LORA, **peft))
    assert expected in str(info.value)


def _refusal(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        preflight(load_config(["data=synthetic", *overrides]))
    return str(info.value)


def test_bad_options_are_refused_before_launch():
    assert "peft.rank=0" in _refusal("peft=lora", "peft.rank=0")
    assert "peft.rank is set but no adapters are chosen (peft=none): add peft=lora" in \
        _refusal("peft.rank=16")
    assert "peft.lora_dtype" in _refusal("peft=lora", "peft.lora_dtype=float33")
    assert "peft=lora with parallelism=megatron_fsdp" in _refusal(
        "peft=lora", "parallelism=megatron_fsdp")
    # the model-level checks run in the preflight, on the meta model
    assert "nearest names: q_proj" in _refusal("peft=lora", "peft.target_modules=[q_prj]")
    assert "trainer.loss=plain" in _refusal("peft=lora", "peft.target_modules=[lm_head]")
    preflight(load_config(["data=synthetic", "peft=lora", "peft.target_modules=[lm_head]",
                           "trainer.loss=plain"]))
    assert "drop 'language' from model.freeze" in _refusal("peft=lora",
                                                           "model.freeze=[language]")


@pytest.mark.parametrize("extra,base", [
    ([], torch.bfloat16),  # (the default policy computes in bfloat16)
    (["parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
      "param_dtype:float32,reduce_dtype:float32}"], torch.float32),
    (["parallelism=none"], torch.float32),  # (model.dtype: one process computes in it)
    (["parallelism=ddp", "parallelism.autocast_dtype=float16"], torch.float16),
    (["peft.base_dtype=float32"], torch.float32),
])
def test_the_frozen_base_is_stored_in_the_compute_dtype(extra, base):
    """``peft.base_dtype`` null: the frozen weights (no optimizer step, no float32 master
    copy) in the dtype the layers compute in; the adapters in ``peft.lora_dtype``."""
    from automodel.peft import adapted_meta_model

    cfg = load_config(["data=synthetic", "model=gemma_tiny", "peft=lora", *extra])
    assert cfg.peft.base_dtype == str(base).removeprefix("torch.")
    model = adapted_meta_model(cfg)
    frozen = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert set(frozen.values()) == {base} and set(trained.values()) == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # (still tied)
    assert "peft.base_dtype is set but no adapters" in _refusal("peft.base_dtype=bfloat16")
    assert "peft.base_dtype" in _refusal("peft=lora", "peft.base_dtype=int8")


def test_unknown_keys_are_refused():
    with pytest.raises(Exception, match="rnak"):
        load_config(["peft=lora", "peft.rnak=4"])
    with pytest.raises(Exception, match="extra"):
        load_config(["peft=lora", "+peft.extra=1"])
    with pytest.raises(Exception) as info:  # (an enum: Hydra's schema checks it)
        load_config(["peft=lora", "peft.init_lora_weights=gauss"])
    assert "gauss" in str(info.value) and "kaiming, gaussian" in str(info.value.__cause__)


def test_an_image_text_model_adapts_its_language_model_only():
    model = build_meta_model(load_config(["model=llava_tiny"]).model)
    names = add_adapters(model, LORA)
    assert names and all(n.startswith("model.language_model.layers.") for n in names)
    everything = add_adapters(build_meta_model(load_config(["model=llava_tiny"]).model),
                              dataclasses.replace(LORA, target_modules=["*.q_proj"]))
    assert any("vision" in n for n in everything)  # (a pattern reaches the tower)
