"""DoRA (``peft.use_dora=true``): each adapted layer gains a trained length per output row.

- in this process, against the ``peft`` package's own DoRA: the same logits and the same
  gradients (A, B and the magnitudes: the row norms are constants in both), and the merged
  weights equal peft's ``merge_and_unload``; the magnitudes start at the base's row norms;
- in layouts: row-wise TP splits the rows' columns, so the norms are summed over the TP
  ranks; DDP, FSDP2 (with accumulation), CP with activation checkpointing and compile, TP2,
  TP2+SP (with accumulation), a pipeline, EP on a MoE model, QLoRA's NF4 base under FSDP2
  and an image-text model match one process; the default precision trains close
  to fp32;
- the export (tests/peft/test_served.py): transformers loads the merged model and peft the
  adapter (``use_dora``), both with the trained logits.
"""


import pytest
import torch

from automodel.config.enums import PeftMethod
from automodel.config.schema import ModelConfig, PeftConfig
from automodel.models.builder import build_model
from automodel.peft import add_adapters, init_adapters
from automodel.peft.export import PEFT_PREFIX, merged, split_state
from automodel.peft.lora import LoraConv1D, fans, lora_modules
from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
from tests.helpers import FP32, train

DORA = ["peft=lora", "peft.rank=4", "peft.alpha=8", "peft.use_dora=true"]
CONFIG = PeftConfig(method=PeftMethod.lora, rank=4, alpha=8.0, use_dora=True)
LLAMA = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                            "intermediate_size": 48, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2})
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# GPT-2's projections are transformers' Conv1D (weights [in, out]): peft's fan_in_fan_out
GPT2 = ModelConfig(config={"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2,
                           "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0,
                           "embd_pdrop": 0.0, "attn_pdrop": 0.0})
MODELS = {"llama": (LLAMA, PROJECTIONS, 14), "gpt2_conv1d": (GPT2, ["c_attn", "c_proj", "c_fc"], 8)}


def _ours_and_peft(family="llama"):
    """(our DoRA model, peft's over the same base, with the same trained-looking adapters)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    config, targets, _ = MODELS[family]
    ours = build_model(config, seed=0)
    add_adapters(ours, CONFIG)
    init_adapters([ours], CONFIG, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in lora_modules(ours).values():  # (as after some steps: B moved, lengths too)
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
            m.lora_magnitude_vector.mul_(1 + 0.1 * torch.rand(fans(m)[1], generator=g))
    theirs = get_peft_model(build_model(config, seed=0), LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, use_dora=True,
        fan_in_fan_out=family == "gpt2_conv1d"))
    _, adapters = split_state(ours.state_dict())
    result = set_peft_model_state_dict(theirs, {PEFT_PREFIX + k: v for k, v in adapters.items()})
    assert not result.unexpected_keys
    return ours, theirs


@pytest.mark.fast
@pytest.mark.parametrize("family", sorted(MODELS))
def test_dora_is_peft_s_dora(family):
    ours, theirs = _ours_and_peft(family)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    out, ref = ours(input_ids=ids, labels=ids), theirs(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    for name, p in ours.named_parameters():
        if p.requires_grad:  # lora_A.weight -> lora_A.default.weight; the magnitude's too
            peft_name = "base_model.model." + name.replace(".weight", ".default.weight") \
                .replace("lora_magnitude_vector", "lora_magnitude_vector.default.weight")
            torch.testing.assert_close(p.grad, grads[peft_name], rtol=1e-4, atol=1e-7)
    assert sum(".lora_magnitude_vector" in n for n, p in ours.named_parameters()
               if p.requires_grad) == MODELS[family][2]


@pytest.mark.fast
@pytest.mark.parametrize("family", sorted(MODELS))
def test_magnitudes_start_at_the_row_norms_and_the_merge_is_peft_s(family):
    config = MODELS[family][0]
    base = build_model(config, seed=0)
    model = build_model(config, seed=0)
    add_adapters(model, CONFIG)
    init_adapters([model], CONFIG, seed=0)
    for name, m in lora_modules(model).items():  # (one length per output: a Conv1D's column)
        weight = base.get_submodule(name).weight
        torch.testing.assert_close(m.lora_magnitude_vector, weight.norm(
            dim=0 if isinstance(m, LoraConv1D) else 1))
    ids = torch.randint(0, 64, (2, 8))  # (B zero and m the norms: the base model)
    torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits)

    ours, theirs = _ours_and_peft(family)
    state, adapters = split_state(ours.state_dict())
    lora = lora_modules(ours)
    record = {"r": 4, "lora_alpha": 8.0, "use_dora": True, "target_modules": sorted(lora),
              "fan_in_fan_out": [n for n, m in lora.items() if isinstance(m, LoraConv1D)]}
    mine = merged(state, adapters, record)
    plain = theirs.merge_and_unload().state_dict()
    for key in plain:
        torch.testing.assert_close(mine[key], plain[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", [
    ["parallelism=ddp"],
    ["parallelism=fsdp2", FP32, "trainer.local_batch_size=2"],  # (2 micro-batches per step)
    ["parallelism=fsdp2", FP32, "mesh.cp_size=2", "parallelism.activation_checkpointing=true",
     "parallelism.enable_compile=true"],
    ["parallelism=fsdp2", FP32, "mesh.tp_size=2"],
    ["parallelism=fsdp2", FP32, "mesh.tp_size=2", "parallelism.sequence_parallel=true",
     "trainer.local_batch_size=4"],
    ["parallelism=fsdp2", FP32, "pipeline=1f1b", "pipeline.pp_microbatch_size=2",
     "parallelism.activation_checkpointing=true"],
])
def test_dora_matches_one_process(layout, reference, tmp_path):
    records = train(layout + DORA, tmp_path)
    assert_matches(records, reference(*DORA))


def test_dora_on_a_moe_model_under_expert_parallelism(reference, tmp_path):
    moe = ["model=qwen3_moe_tiny", "trainer.loss=plain",
           "peft.target_modules=[*_proj,lm_head]"] + DORA
    records = train(["parallelism=fsdp2", FP32, "mesh.dp_size=2", "mesh.ep_size=2"] + moe,
                    tmp_path)
    assert_matches(records, reference(*moe))


def test_dora_over_qlora_s_nf4_base(reference, tmp_path):
    run = ["peft=qlora", "peft.rank=4", "peft.alpha=8", "peft.nf4_scaler_block_size=8",
           "peft.use_dora=true"]
    records = train(["parallelism=fsdp2", FP32] + run, tmp_path)
    assert_matches(records, reference(*run))


def test_dora_on_an_image_text_model(reference, tmp_path):
    vlm = ["model=llava_tiny", "data.image_every=2", "trainer.loss=plain",
           "peft.target_modules=[*language_model*_proj,lm_head]"] + DORA
    records = train(["parallelism=fsdp2", FP32, "trainer.local_batch_size=1"] + vlm, tmp_path)
    assert_matches(records, reference(*vlm))


def test_dora_trains_under_the_default_precision(reference, tmp_path):
    records = train(["parallelism=fsdp2"] + DORA, tmp_path)
    assert_close_to_fp32(records, reference(*DORA), loss_rtol=2e-2)
