"""The real-size model presets (conf/model/llama3_1_8b.yaml ... deepseek_v3.yaml) and a
``model.pretrained_path`` holding only a config.json: each composes with a layout that suits it,
passes the preflight, and builds on the meta device (never with weights) with its published
parameter count. Training from a config.json alone is refused before any rank starts."""

import json

import pytest
import torch

from automodel.api import load_config
from automodel.checks.preflight import preflight
from automodel.config.build import ConfigError
from automodel.models.builder import build_meta_model, build_model, check_weights, hf_config
from automodel.models.experts import expert_modules

# (not fast: the preflight's fake step of a real-size layout, 70B under an interleaved
# pipeline, 405B over 8 stages, takes seconds each; docs/contributing.md)

# preset: (class, published total parameters, a layout for it (world size), published active)
PRESETS = {
    "llama3_1_8b": ("LlamaForCausalLM", 8.03e9, ["mesh.dp_size=8", "mesh.tp_size=8"], 64, None),
    "llama3_1_70b": ("LlamaForCausalLM", 70.6e9,
                     ["mesh.dp_size=16", "mesh.tp_size=8", "mesh.pp_size=4",
                      "pipeline=interleaved", "trainer.global_batch_size=512"], 512, None),
    "llama3_1_405b": ("LlamaForCausalLM", 405.9e9,
                      ["mesh.dp_size=16", "mesh.tp_size=8", "mesh.pp_size=8", "pipeline=1f1b",
                       "trainer.global_batch_size=256"], 1024, None),
    "qwen3_8b": ("Qwen3ForCausalLM", 8.19e9,
                 ["parallelism=hsdp", "mesh.dp_replicate_size=2", "mesh.dp_size=8",
                  "mesh.tp_size=4"], 32, None),
    "qwen3_30b_a3b": ("Qwen3MoeForCausalLM", 30.5e9,
                      ["mesh.dp_size=32", "mesh.ep_size=8", "trainer.global_batch_size=64"],
                      32, 3.3e9),
    # without the multi-token-prediction layer (the checkpoint's 14B more; transformers' model
    # has none): DeepSeek's own 671B, 37B active
    "deepseek_v3": ("DeepseekV3ForCausalLM", 671e9,
                    ["mesh.dp_size=64", "mesh.ep_size=64", "mesh.pp_size=4", "pipeline=1f1b",
                     "trainer.global_batch_size=512"], 256, 37e9),
}


def _checked_meta_model(overrides, tmp_path):
    """The resolved config and its model, through the planner's path: load_config, the
    preflight for a job whose GPUs are not here, build_meta_model."""
    cfg = load_config(overrides, output_dir=str(tmp_path))
    preflight(cfg, gpus=None)
    model = build_meta_model(cfg.model)
    assert all(p.is_meta for p in model.parameters())
    return cfg, model


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", PRESETS)
def test_real_preset_builds_on_meta_with_its_published_size(preset, tmp_path):
    cls, total, layout, world, active = PRESETS[preset]
    cfg, model = _checked_meta_model([f"model={preset}", *layout], tmp_path)
    assert (cfg.model.name, cfg.model.dtype, type(model).__name__) == (preset, "bfloat16", cls)
    assert cfg.distributed.nproc_per_node == world  # (the layout was taken)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert _count(model) == pytest.approx(total, rel=0.005)
    if active is not None:
        assert _active(model) == pytest.approx(active, rel=0.02)  # (published to 2 digits)


def _active(model) -> int:
    """Parameters one token passes through: all but the routed experts it is not sent to."""
    c = model.config
    experts = expert_modules(model)
    routed = sum(p.numel() for m in experts.values() for p in m.parameters())
    num = getattr(c, "n_routed_experts", None) or c.num_experts
    sparse = c.num_hidden_layers - getattr(c, "first_k_dense_replace", 0)
    assert len(experts) == sparse  # every sparse layer's experts, and only those
    assert routed == sparse * num * 3 * c.hidden_size * c.moe_intermediate_size
    return _count(model) - routed + routed * c.num_experts_per_tok // num


# Llama 3.1 70B's config.json as published (its keys as transformers 4.43 wrote them)
LLAMA_3_1_70B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 8192, "initializer_range": 0.02, "intermediate_size": 28672,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def test_config_json_alone_is_checked_and_built_but_not_trained(tmp_path):
    ckpt = tmp_path / "llama3_1_70b"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(LLAMA_3_1_70B))
    layout = PRESETS["llama3_1_70b"][2]
    cfg, model = _checked_meta_model(["model=pretrained", f"model.pretrained_path={ckpt}",
                                      "model.dtype=bfloat16", *layout], tmp_path / "run")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert _count(model) == pytest.approx(70.6e9, rel=0.005)
    # the preset is that architecture: the same config as transformers reads the published one
    preset = load_config(["model=llama3_1_70b"], output_dir=str(tmp_path / "preset")).model
    metadata = {"_name_or_path", "architectures", "dtype", "transformers_version"}
    published, ours = hf_config(cfg.model).to_dict(), hf_config(preset).to_dict()
    assert {k: v for k, v in published.items() if k not in metadata} == \
        {k: v for k, v in ours.items() if k not in metadata}

    from automodel.launch.local import launch

    one = load_config(["model=pretrained", f"model.pretrained_path={ckpt}", "parallelism=none"],
                      output_dir=str(tmp_path / "one"))  # (one rank: it would run here)
    for train in (lambda: launch(one), lambda: build_model(cfg.model, seed=0)):
        with pytest.raises(ConfigError, match=r"model.pretrained_path=.* holds no weights "
                                              r"\(none of model.safetensors, .*model.config"):
            train()  # (launch: before the rank starts; build_model: where weights are read)
    (ckpt / "model.safetensors.index.json").write_text("{}")
    check_weights(cfg.model)  # a checkpoint's weights are found
