"""A fine-tune's export, served: on each tiny family, a run with adapters exports at its end
(``checkpoint.export_hf=final``, streamed by the job's ranks); transformers loads the merged
model alone and greedily generates 16 tokens, which must be the tokens (and the logits, fp32)
of ``PeftModel.from_pretrained(base, adapter)``, the adapter the same export wrote; and its
logits are those of the model as it trained (the base with the checkpoint's adapters).

Families: tied embeddings (Gemma: trained, stopped, resumed, then exported) and untied ones;
LoRA, QLoRA and DoRA; an image-text model; a MoE model with expert adapters; GPT-2, whose
projections are ``Conv1D`` layers.
"""

import json
import os

import pytest
import torch

from automodel.api import load_config
from automodel.checkpoint.paths import checkpoint_path
from automodel.models.builder import build_model
from automodel.peft.export import trained_base
from tests.helpers import FP32, job_overrides, train
from tests.peft.exported import trained_model

ADAPTERS = ["peft.rank=4", "peft.alpha=8"]
FSDP2 = ["parallelism=fsdp2", FP32]
RUN = ["trainer.max_steps=3", "checkpoint.every_steps=2", "checkpoint.export_hf=final"]
CASES = {  # the base's preset (and config), the run's options
    "tied_lora": (["model=gemma_tiny"], ["peft=lora"] + FSDP2),
    "untied_qlora": (["model=llama_tiny"], ["peft=qlora", "peft.nf4_scaler_block_size=8",
                                            "parallelism=none"]),
    "dora": (["model=qwen3_tiny"], ["peft=lora", "peft.use_dora=true", "parallelism=ddp"]),
    "image_text": (["model=llava_tiny"], ["peft=lora", "data.image_every=2"] + FSDP2),
    "moe_experts": (["model=qwen3_moe_tiny", "model.config.output_router_logits=false"],
                    ["peft=lora", "peft.experts=true", "mesh.ep_size=2"] + FSDP2),
    "gpt2_conv1d": (["model=gpt2_tiny"], ["peft=lora"] + FSDP2),
}
PROMPT = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(0))


def _base(model: list, where) -> str:
    """The family's tiny model saved as a pretrained directory (the base)."""
    path = str(where / "base")
    build_model(load_config(model).model, seed=0).save_pretrained(path)
    return path


def _generate(model):
    """(16 greedily generated tokens after the prompt, the logits over the whole sequence)."""
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             pad_token_id=0)
        return out[:, PROMPT.shape[1]:], model(input_ids=out).logits


def _qlora_base(base, adapter: str):
    """The base the QLoRA adapters trained over: each adapted weight's NF4 values."""
    with open(os.path.join(os.path.dirname(adapter), "trainer.json")) as f:
        record = json.load(f)["peft"]
    with torch.no_grad():
        for module in record["target_modules"]:
            weight = base.get_submodule(module).weight
            weight.copy_(trained_base(weight, record))
    return base


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_merged_export_serves_as_peft_serves_the_adapter(case, tmp_path):
    from peft import PeftModel

    from automodel.models.multimodal import auto_class

    model, options = CASES[case]
    run = ["model=pretrained", f"model.pretrained_path={_base(model, tmp_path)}", *options,
           *ADAPTERS, *RUN]
    if case == "tied_lora":  # stopped after step 2's checkpoint, resumed to the end
        train(run + ["trainer.stop_at_step=2"], tmp_path / "run")
        records = train(run + ["checkpoint.resume=auto"], tmp_path / "run")
        assert [r["step"] for r in records] == [3]
    else:
        train(run, tmp_path / "run")
    step = checkpoint_path(str(tmp_path / "run" / "checkpoints"), 3)
    merged_dir, adapter = os.path.join(step, "hf"), os.path.join(step, "hf_adapter")
    from transformers import AutoConfig

    cls = auto_class(AutoConfig.from_pretrained(merged_dir))
    merged = cls.from_pretrained(merged_dir).eval()
    assert merged.dtype == torch.float32  # (the base's dtype: the model's source)
    assert os.path.isfile(os.path.join(merged_dir, "generation_config.json"))
    with open(os.path.join(step, "trainer.json")) as f:
        assert json.load(f)["model_source"] == {"path": str(tmp_path / "base"),
                                                "dtype": "float32"}
    base = cls.from_pretrained(str(tmp_path / "base")).eval()
    if case == "untied_qlora":
        base = _qlora_base(base, adapter)
    served = PeftModel.from_pretrained(base, adapter).eval()
    tokens, logits = _generate(merged)
    their_tokens, their_logits = _generate(served)
    assert torch.equal(tokens, their_tokens)
    torch.testing.assert_close(logits, their_logits, rtol=1e-5, atol=1e-5)
    # and the model as it trained (the base, the checkpoint's adapters: under QLoRA the NF4
    # weights dequantized as it runs) gives the same logits
    trained = trained_model(load_config(job_overrides(run)), step)
    with torch.no_grad():
        torch.testing.assert_close(trained(input_ids=PROMPT).logits,
                                   merged(input_ids=PROMPT).logits, rtol=1e-4, atol=1e-5)
    plain = _generate(cls.from_pretrained(str(tmp_path / "base")).eval())[1]
    assert not torch.allclose(logits, plain, atol=1e-3)  # (the adapters changed the model)
    if case == "tied_lora":
        assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
