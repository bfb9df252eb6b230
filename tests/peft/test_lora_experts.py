"""Adapters on MoE experts (``peft.experts=true``): a low-rank pair per expert of each fused
3-D weight, beside it.

- in this process: the adapters' names and shapes, the base model at the start, and, against
  the ``peft`` package's LoRA on expert parameters (``target_parameters``), the same logits
  from our adapters written in peft's layout, and the same merged weights;
- refused before launch: a model without experts, dropout or DoRA with expert adapters, TP,
  and an experts module automodel does not know;
- in layouts: expert parallelism (the adapters split with their experts) with gradient
  accumulation matches one process; the default precision trains close to fp32; the merged
  export and the peft adapter of an EP job equal one process's.
"""

import os

import pytest
import torch

from automodel.api import load_config
from automodel.checkpoint.paths import checkpoint_path
from automodel.config.build import ConfigError
from automodel.models.builder import build_meta_model, build_model
from automodel.models.experts import expert_modules
from automodel.peft import AdapterError, adapter_targets, add_adapters, init_adapters
from automodel.peft.experts import adapted_experts, expert_targets
from automodel.peft.export import PEFT_PREFIX, _in_peft_layout, adapter_record, merged, split_state
from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
from tests.helpers import FP32, job_overrides, train

MOE = ["model=qwen3_moe_tiny", "peft=lora", "peft.rank=4", "peft.alpha=8", "peft.experts=true"]


def _adapted(cfg, seed=0, moved=False):
    model = build_model(cfg.model, seed=seed)
    add_adapters(model, cfg.peft)
    init_adapters([model], cfg.peft, seed)
    if moved:  # (as after some steps: B away from zero)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("_lora_B") or n.endswith("lora_B.weight"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.mark.fast
def test_expert_adapters_are_peft_s_lora_on_expert_parameters():
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    cfg = load_config(["data=synthetic", "parallelism=none", *MOE])  # (float32)
    base = build_model(cfg.model, seed=0)
    model = _adapted(cfg)
    experts = model.model.layers[0].mlp.experts
    shapes = {n: tuple(p.shape) for n, p in experts.named_parameters() if p.requires_grad}
    assert shapes == {"gate_up_proj_lora_A": (8, 4, 64), "gate_up_proj_lora_B": (8, 64, 4),
                      "down_proj_lora_A": (8, 4, 32), "down_proj_lora_B": (8, 64, 4)}
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits)

    model = _adapted(cfg, moved=True)
    record = adapter_record(cfg.peft, sorted(adapted_experts(model)), cfg.model, 0,
                            expert_targets(model))
    record["target_modules"] = sorted(n for n, m in model.named_modules()
                                      if hasattr(m, "lora_A"))
    state, adapters = split_state(model.state_dict())
    theirs = get_peft_model(build_model(cfg.model, seed=0), LoraConfig(
        r=4, lora_alpha=8, target_modules=record["target_modules"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    result = set_peft_model_state_dict(theirs, _in_peft_layout(adapters, record))
    assert not result.unexpected_keys
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert not torch.allclose(logits, base(input_ids=ids).logits, atol=1e-3)
        torch.testing.assert_close(theirs(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-6)
    mine, plain = merged(state, adapters, record), theirs.merge_and_unload().state_dict()
    assert PEFT_PREFIX not in "".join(mine)
    for key in plain:
        torch.testing.assert_close(mine[key], plain[key], rtol=1e-5, atol=1e-6)


@pytest.mark.fast
@pytest.mark.parametrize("overrides,expected", [
    (MOE + ["peft.dropout=0.1"], "peft.experts=true with peft.dropout=0.1"),
    (MOE + ["peft.use_dora=true"], "peft.experts=true with peft.use_dora=true"),
    (MOE + ["parallelism=fsdp2", "mesh.tp_size=2"], "peft.experts=true with mesh.tp_size=2"),
])
def test_what_expert_adapters_cannot_do_is_refused(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(["data=synthetic", *overrides])
    assert expected in str(info.value)


@pytest.mark.fast
def test_a_model_without_known_experts_is_refused():
    llama = load_config(["data=synthetic", "peft=lora", "peft.experts=true"])
    with pytest.raises(AdapterError, match="LlamaForCausalLM has no MoE experts"):
        adapter_targets(build_meta_model(llama.model), llama.peft)
    cfg = load_config(["data=synthetic", *MOE])
    model = build_meta_model(cfg.model)
    for m in expert_modules(model).values():  # (as an experts module of another making)
        del m.is_transposed
    with pytest.raises(AdapterError, match="is not an experts module automodel knows"):
        adapter_targets(model, cfg.peft)


def test_expert_adapters_under_expert_parallelism_match_one_process(reference, tmp_path):
    run = MOE + ["trainer.loss=plain", "peft.target_modules=[*_proj,lm_head]"]
    records = train(["parallelism=fsdp2", FP32, "mesh.dp_size=2", "mesh.ep_size=2",
                     "trainer.local_batch_size=2"] + run, tmp_path)
    assert_matches(records, reference(*run))


def test_expert_adapters_train_under_the_default_precision(reference, tmp_path):
    records = train(["parallelism=fsdp2", "mesh.dp_size=2"] + MOE, tmp_path)
    assert_close_to_fp32(records, reference(*MOE), loss_rtol=2e-2)


def test_an_expert_parallel_export_holds_every_expert(tmp_path):
    from safetensors.torch import load_file

    run = MOE + ["checkpoint.every_steps=3", "trainer.max_steps=3", "checkpoint.export_hf=true"]
    train(["parallelism=none"] + run, tmp_path / "one")
    train(["parallelism=fsdp2", FP32, "mesh.dp_size=2", "mesh.ep_size=2"] + run,
          tmp_path / "ep")
    one, ep = (checkpoint_path(str(tmp_path / d / "checkpoints"), 3) for d in ("one", "ep"))
    for name in ("hf/model.safetensors", "hf_adapter/adapter_model.safetensors"):
        a, b = load_file(os.path.join(one, name)), load_file(os.path.join(ep, name))
        assert set(a) == set(b)  # every expert of both EP ranks, every adapter
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)
    adapters = load_file(os.path.join(ep, "hf_adapter/adapter_model.safetensors"))
    assert adapters["base_model.model.model.layers.0.mlp.experts.lora_B.weight"].shape \
        == (64, 4 * 8)  # (down_proj's B: out x rank x experts, as peft keeps it)
    # peft loads the adapter over the base, transformers the merged model: the same logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = load_config(job_overrides(run))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = build_model(cfg.model, seed=cfg.trainer.seed)
        before = base(input_ids=ids).logits
        with_peft = PeftModel.from_pretrained(base, os.path.join(ep, "hf_adapter")).eval()
        merged_model = AutoModelForCausalLM.from_pretrained(os.path.join(ep, "hf")).eval()
        logits = merged_model(input_ids=ids).logits
        assert not torch.allclose(logits, before, atol=1e-3)
        torch.testing.assert_close(with_peft(input_ids=ids).logits, logits, rtol=1e-4,
                                   atol=1e-5)
