"""QLoRA (``peft=qlora``): the adapted layers' weights stored in NF4 (torchao), dequantized on
use, the adapters trained over them.

- in this process: the weights really are 4-bit (bytes), the forward is the dequantized model
  plus the adapters, and what cannot take NF4 is refused before launch;
- in layouts: FSDP2 (dp2, with accumulation; one rank), DDP, HSDP, CP with activation checkpointing
  and compile, a pipeline over FSDP2 with activation checkpointing, EP on a MoE model and an
  image-text model match one process (fp32: every rank holds the same
  4-bit values one process does, each weight quantized whole and split in whole scale
  groups); one process under the defaults (FSDP2 on one rank, bfloat16) trains close to
  fp32;
- the export (tests/peft/test_served.py): the merged model (the adapters added to the NF4
  values) gives the trained model's logits in transformers, the adapter gives them in peft
  over those values.
"""


import pytest
import torch

from automodel.api import load_config
from automodel.checks.preflight import check_adapters
from automodel.config.build import ConfigError
from automodel.config.enums import PeftMethod
from automodel.config.schema import ModelConfig, PeftConfig
from automodel.models.builder import build_model
from automodel.peft import add_adapters, init_adapters
from automodel.peft.lora import lora_modules
from automodel.peft.nf4 import dequantized, is_nf4, to_nf4
from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
from tests.helpers import FP32, train

# (the tiny model's k_proj is 32 x 64 = 32 blocks of 64: scale groups of 8 blocks split in 2)
QLORA = ["peft=qlora", "peft.rank=4", "peft.alpha=8", "peft.nf4_scaler_block_size=8"]
NF4 = PeftConfig(method=PeftMethod.qlora, rank=4, alpha=8.0, nf4_scaler_block_size=8)
LLAMA = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                            "intermediate_size": 48, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2})


def _nbytes(weight) -> int:  # (the values and their scales; not the 16 levels)
    return sum(getattr(weight, n).nbytes
               for n in ("quantized_data", "quantized_scalers", "quantization_factor"))


@pytest.mark.fast
def test_the_weights_are_4_bit_and_the_forward_is_the_dequantized_model_plus_adapters():
    base = build_model(LLAMA, seed=0)
    model = build_model(LLAMA, seed=0)
    names = add_adapters(model, NF4)
    init_adapters([model], NF4, seed=0)
    layers = lora_modules(model)
    for m in layers.values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.05)
    for name, m in layers.items():
        assert is_nf4(m.weight) and not m.weight.requires_grad
        assert _nbytes(m.weight) < 0.6 * m.weight.numel()  # (float32: 4 bytes a value)
        original = base.get_submodule(name).weight
        values = dequantized(m.weight)
        assert not torch.equal(values, original)  # (quantized: not the weight as it was)
        assert torch.equal(values, dequantized(to_nf4(original, 64, 8)))  # (quantized whole)
        # NF4's 16 levels: an error about half the widest gap (0.28 of a block's largest
        # magnitude, that magnitude itself stored in 8 bits)
        assert (values - original).abs().max() <= 0.2 * original.abs().max()
        # the reference: a plain layer holding the dequantized values, plus the update
        with torch.no_grad():
            base.get_submodule(name).weight.copy_(values + m.scaling * m.lora_B.weight
                                                  @ m.lora_A.weight)
    assert len(names) == 14 and {n for n, p in model.named_parameters() if p.requires_grad} \
        == {f"{n}.lora_{ab}.weight" for n in names for ab in "AB"}
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits,
                               rtol=1e-5, atol=1e-5)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # (the input's gradient passes the frozen 4-bit weights)
    assert all(m.lora_A.weight.grad.abs().max() > 0 for m in layers.values())


@pytest.mark.fast
@pytest.mark.parametrize("shape,block,scaler", [((8, 512), 64, 4), ((96, 64), 64, 8),
                                                ((2, 2048), 32, 16)])
def test_a_meta_weight_takes_the_nf4_form_torchao_gives_it(shape, block, scaler,
                                                           monkeypatch):
    """The NF4 form of a meta weight made from one scale group's (``nf4._meta_nf4``, what a
    model build and the planner quantize) is torchao's: sizes, strides, dtypes and block
    counts of the tensor and of every inner tensor. torchao quantizes one scale group at most,
    never the whole weight."""
    from automodel.peft import nf4

    torchao = nf4._torchao()
    quantized, original = [], torchao.to_nf4
    monkeypatch.setattr(torchao, "to_nf4",
                        lambda t, *a: quantized.append(t.numel()) or original(t, *a))
    nf4._one_group.cache_clear()
    for dtype in (torch.bfloat16, torch.float32):
        weight = torch.empty(*shape, dtype=dtype, device="meta")
        ours = to_nf4(weight, block, scaler)
        assert max(quantized) == block * scaler < weight.numel(), quantized
        theirs = original(weight, block, scaler)
        assert is_nf4(ours) and type(ours) is type(theirs)
        for name in ("block_size", "n_blocks", "scaler_block_size"):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert (ours.shape, ours.stride(), ours.dtype, ours.device) == \
            (theirs.shape, theirs.stride(), theirs.dtype, theirs.device)
        for name in ("quantized_scalers", "quantization_factor", "scaler_mean", "quantized_data",
                     "nf4"):
            a, b = getattr(ours, name), getattr(theirs, name)
            assert (a.shape, a.stride(), a.dtype, a.device) == \
                (b.shape, b.stride(), b.dtype, b.device), name


@pytest.mark.fast
@pytest.mark.parametrize("overrides,expected", [
    (QLORA + ["parallelism=fsdp2", "mesh.tp_size=2"],
     "peft=qlora with mesh.tp_size=2: NF4 weights split only by whole rows"),
    (["peft=lora", "peft.nf4_block_size=32"],
     "peft.nf4_block_size is set but peft=lora: it applies to peft=qlora"),
    (QLORA + ["peft.nf4_block_size=33"], "peft.nf4_block_size=33: an even number"),
    (QLORA + ["peft.nf4_scaler_block_size=0"], "peft.nf4_scaler_block_size=0: at least 1"),
    (QLORA + ["parallelism=megatron_fsdp"], "peft=qlora with parallelism=megatron_fsdp"),
])
def test_options_and_layouts_that_cannot_take_nf4_are_refused(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(["data=synthetic", *overrides])
    assert expected in str(info.value)


@pytest.mark.fast
def test_weights_that_do_not_split_into_whole_scale_groups_are_refused_before_launch():
    # default sizes: 64 x 256 = 16384 values a scale group; q_proj is 64 x 64 = 4096
    cfg = load_config(["data=synthetic", "peft=qlora"])
    with pytest.raises(ConfigError) as info:
        check_adapters(cfg)
    assert "model.layers.0.self_attn.q_proj's weight [64, 64] (4096 values) is not a whole " \
           "number of NF4 scale groups" in str(info.value)
    # 16 blocks a group: k_proj (32 x 64) holds 2 groups, not 4 FSDP2 shards of whole groups
    cfg = load_config(["data=synthetic", "parallelism=fsdp2", "mesh.dp_size=4", "peft=qlora",
                       "peft.nf4_scaler_block_size=16"])
    with pytest.raises(ConfigError) as info:
        check_adapters(cfg)
    assert "k_proj's weight [32, 64] in NF4 does not split into 4 FSDP2 shards" \
        in str(info.value)
    check_adapters(load_config(["data=synthetic", "parallelism=fsdp2", "mesh.dp_size=2",
                                *QLORA]))


@pytest.mark.parametrize("layout", [
    ["parallelism=fsdp2", FP32, "trainer.local_batch_size=2"],  # (2 micro-batches per step)
    # FSDP2 on one rank (one GPU: where QLoRA is used most) gathers nothing
    ["parallelism=fsdp2", FP32, "distributed.nproc_per_node=1"],
    ["parallelism=ddp"],
    ["parallelism=hsdp", FP32, "trainer.local_batch_size=1"],  # (2 x 2 ranks)
    ["parallelism=fsdp2", FP32, "mesh.cp_size=2", "parallelism.activation_checkpointing=true",
     "parallelism.enable_compile=true"],
    ["parallelism=fsdp2", FP32, "pipeline=1f1b", "pipeline.pp_microbatch_size=2",
     "mesh.dp_size=2", "parallelism.activation_checkpointing=true"],
])
def test_qlora_matches_one_process(layout, reference, tmp_path):
    records = train(layout + QLORA, tmp_path)
    assert_matches(records, reference(*QLORA))


def test_qlora_on_a_moe_model_under_expert_parallelism(reference, tmp_path):
    # the attention's projections and the LM head in NF4 with adapters; the experts (fused
    # 3-D weights, split over 2 EP ranks) stay in full precision without adapters
    moe = ["model=qwen3_moe_tiny", "trainer.loss=plain",
           "peft.target_modules=[*_proj,lm_head]"] + QLORA
    records = train(["parallelism=fsdp2", FP32, "mesh.dp_size=2", "mesh.ep_size=2"] + moe,
                    tmp_path)
    assert_matches(records, reference(*moe))


def test_qlora_on_an_image_text_model(reference, tmp_path):
    # the language model's projections and the LM head in NF4 with adapters (the head under
    # the plain loss: attention and MLP adapters alone learn too little in 5 steps for parity
    # to mean much); the vision tower frozen in full precision
    run = ["model=llava_tiny", "data.image_every=2", "trainer.loss=plain",
           "peft.target_modules=[*language_model*_proj,lm_head]"] + QLORA
    records = train(["parallelism=fsdp2", FP32] + run, tmp_path)
    assert_matches(records, reference(*run))


def test_qlora_trains_on_one_process_under_the_defaults(reference, tmp_path):
    # parallelism=fsdp2 (the default) on one rank, the default bfloat16 policy
    records = train(["distributed.nproc_per_node=1"] + QLORA, tmp_path)
    assert_close_to_fp32(records, reference(*QLORA), loss_rtol=2e-2)
