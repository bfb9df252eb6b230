"""The export of a LoRA run (``checkpoint.export_hf=true``): the merged model loads in
transformers, the adapter in peft (``PeftModel.from_pretrained`` over the base model), and
both give the trained model's logits; a pipeline x tensor-parallel job's export holds every
stage and shard, equal to one process's."""

import json
import os

import pytest
import torch

from automodel.api import load_config
from automodel.checkpoint.hf_export import load_full_model_state
from automodel.checkpoint.paths import checkpoint_path
from automodel.models.builder import build_model
from automodel.peft import add_adapters
from tests.helpers import FP32, train

LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8", "checkpoint.every_steps=3",
        "trainer.max_steps=3", "checkpoint.export_hf=true"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny pretrained model on disk (the base the adapters are trained on)."""
    path = tmp_path_factory.mktemp("base")
    cfg = load_config([])
    build_model(cfg.model, seed=0).save_pretrained(str(path))
    return str(path)


def _trained(run: list, step_dir: str):
    """The model as trained: base + adapters, with the checkpoint's weights."""
    cfg = load_config(run)
    model = build_model(cfg.model, seed=0)
    add_adapters(model, cfg.peft, str(cfg.trainer.loss))
    state = load_full_model_state(step_dir)
    assert state and all(".lora_" in k for k in state)  # (the base is referenced, not saved)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not any(".lora_" in k for k in missing)
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_merged_model_and_the_peft_adapter_give_the_trained_logits(base_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = ["model=pretrained", f"model.pretrained_path={base_dir}"] + LORA
    train(["parallelism=none"] + run, tmp_path)
    step = checkpoint_path(str(tmp_path / "checkpoints"), 3)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    trained = _logits(_trained(run, step), ids)
    base = _logits(AutoModelForCausalLM.from_pretrained(base_dir).eval(), ids)
    assert not torch.allclose(trained, base, atol=1e-3)  # (the adapters moved it)

    merged = AutoModelForCausalLM.from_pretrained(os.path.join(step, "hf")).eval()
    torch.testing.assert_close(_logits(merged, ids), trained, rtol=1e-4, atol=1e-5)

    adapter = os.path.join(step, "hf_adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["base_model_name_or_path"] == base_dir
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                          adapter).eval()
    torch.testing.assert_close(_logits(with_peft, ids), trained, rtol=1e-4, atol=1e-5)


def test_a_pipeline_times_tensor_parallel_export_holds_every_stage_and_shard(base_dir,
                                                                             tmp_path):
    from safetensors.torch import load_file

    run = ["model=pretrained", f"model.pretrained_path={base_dir}"] + LORA
    train(["parallelism=none"] + run, tmp_path / "one")
    train(["parallelism=fsdp2", FP32, "pipeline=1f1b", "pipeline.pp_microbatch_size=2",
           "mesh.tp_size=2", "parallelism.sequence_parallel=true"] + run, tmp_path / "pptp")
    one, pptp = (checkpoint_path(str(tmp_path / d / "checkpoints"), 3) for d in ("one", "pptp"))
    for name in ("hf/model.safetensors", "hf_adapter/adapter_model.safetensors"):
        a, b = load_file(os.path.join(one, name)), load_file(os.path.join(pptp, name))
        assert set(a) == set(b)  # every layer of both stages, every adapter
        for key in a:  # whole tensors (both TP shards), equal to one process's
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)
    adapters = load_file(os.path.join(pptp, "hf_adapter/adapter_model.safetensors"))
    assert len(adapters) == 2 * 7 * 4 and all(k.startswith("base_model.model.model.layers.")
                                              for k in adapters)
