"""LoRA in every layout (data, tensor, sequence, context, pipeline and expert parallelism):
losses and the adapters' gradient norms match one process (fp32), with gradient accumulation
too; the default precision trains close to fp32;
the base weights really stay as loaded while the adapters move (read back from the run's
checkpoint: FSDP2 shards frozen and trainable weights in the same units); under TP each
adapter is placed as its layer's style asks, the replicated ones stay equal on every TP rank,
and nothing frozen becomes trainable."""

import glob
import json

import pytest
import torch

from automodel.api import load_config
from automodel.checkpoint.hf_export import load_full_model_state
from automodel.checkpoint.verify import read_metadata
from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
from tests.helpers import FP32, job_overrides, train

LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8"]


@pytest.mark.parametrize("layout", [
    ["parallelism=ddp"],
    ["parallelism=fsdp2", FP32, "trainer.local_batch_size=2"],  # (2 micro-batches per step)
    ["parallelism=hsdp", FP32, "trainer.local_batch_size=1"],  # (2 x 2 ranks)
    ["parallelism=fsdp2", FP32, "mesh.tp_size=2"],
    ["parallelism=fsdp2", FP32, "mesh.tp_size=2", "parallelism.sequence_parallel=true",
     "trainer.local_batch_size=4"],
    ["parallelism=fsdp2", FP32, "mesh.cp_size=2"],
    # activation checkpointing (non-reentrant: the adapters' gradients survive the recompute),
    # full with accumulation, selective, and full under compile
    ["parallelism=fsdp2", FP32, "parallelism.activation_checkpointing=true",
     "trainer.local_batch_size=2"],
    ["parallelism=fsdp2", FP32, "parallelism.activation_checkpointing=selective"],
    ["parallelism=fsdp2", FP32, "parallelism.activation_checkpointing=true",
     "parallelism.enable_compile=true"],
    # several stages per rank; the backward split in input and weight gradients (frozen
    # weights take none); stages passing sequence shards under TP+SP
    ["parallelism=fsdp2", FP32, "pipeline=interleaved", "pipeline.pp_microbatch_size=2"],
    ["parallelism=fsdp2", FP32, "pipeline=zero_bubble", "pipeline.pp_microbatch_size=2"],
    ["parallelism=fsdp2", FP32, "pipeline=1f1b", "pipeline.pp_microbatch_size=2",
     "mesh.tp_size=2", "parallelism.sequence_parallel=true"],
])
def test_lora_matches_one_process(layout, reference, tmp_path):
    records = train(layout + LORA, tmp_path)
    assert_matches(records, reference(*LORA))


def test_adapters_on_conv1d_layers_match_one_process(reference, tmp_path):
    # GPT-2's projections are transformers' Conv1D (weights [in, out]): adapted as peft
    # adapts them (fan_in_fan_out), here over NF4 (QLoRA: the weight [in, out] quantized and
    # sharded by its rows), under FSDP2 with accumulation (LoRA's and DoRA's Conv1D layers
    # against peft's: tests/peft/test_dora.py, test_served.py)
    gpt2 = ["model=gpt2_tiny", "peft.rank=4", "peft.alpha=8", "peft=qlora",
            "peft.nf4_scaler_block_size=8"]
    records = train(["parallelism=fsdp2", FP32, "trainer.local_batch_size=2"] + gpt2, tmp_path)
    assert_matches(records, reference(*gpt2))


def test_lora_on_a_moe_model_under_expert_parallelism(reference, tmp_path):
    # the experts take no adapters (a warning says so); the attention's and the LM head's
    # train (the head under the plain loss: attention adapters alone learn too little in 5
    # steps for parity to mean much), with the experts split over 2 EP ranks
    moe = ["model=qwen3_moe_tiny", "trainer.loss=plain",
           "peft.target_modules=[*_proj,lm_head]"] + LORA
    records = train(["parallelism=fsdp2", FP32, "mesh.dp_size=2", "mesh.ep_size=2"] + moe,
                    tmp_path)
    assert_matches(records, reference(*moe))


def test_lora_trains_under_the_default_precision_and_saves_the_adapters_only(reference,
                                                                              tmp_path):
    records = train(["parallelism=fsdp2", "checkpoint.every_steps=5"] + LORA, tmp_path)
    assert_close_to_fp32(records, reference(*LORA), loss_rtol=2e-2)
    (saved,) = glob.glob(str(tmp_path / "checkpoints" / "*"))
    meta = read_metadata(saved).state_dict_metadata
    model_keys = {k for k in meta if k.startswith("model.")}
    optim_keys = {k for k in meta if k.startswith("optim.")}
    assert len(model_keys) == 2 * 7 * 4  # A and B, 7 projections, 4 blocks: no base weight
    assert all(".lora_" in k for k in model_keys | optim_keys)  # (nor its optimizer state)
    state = load_full_model_state(saved)
    b = [v for k, v in state.items() if k.endswith("lora_B.weight")]
    assert all(t.abs().max() > 0 for t in b)  # B started at zero and trained
    with open(f"{saved}/trainer.json") as f:
        base = json.load(f)["peft"]["base"]  # the base, referenced: config, dtype and seed
    assert base["seed"] == load_config(job_overrides(LORA)).trainer.seed


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_lora_on_an_image_text_model_with_each_frozen_sharding_policy(policy, reference,
                                                                     tmp_path):
    # the language model's projections get adapters, the tower none: it is a frozen tower
    # (every other sample has an image: with one sample per rank, one rank has none). The LM
    # head gets adapters too, under the plain loss: with a frozen head of random weights the
    # logits hardly move in 5 steps, and parity needs a run that learns
    vlm = ["model=llava_tiny", "data.image_every=2", "trainer.loss=plain",
           "peft.target_modules=[*language_model*_proj,lm_head]"] + LORA
    records = train(["parallelism=fsdp2", FP32, "trainer.local_batch_size=1",
                     f"parallelism.multimodal.frozen_sharding={policy}"] + vlm, tmp_path)
    assert_matches(records, reference(*vlm))


def _tp_adapters(rank, world, extra):
    """Placements, trainable names and the replicated adapters after three steps, TP2+SP."""
    from torch.distributed.tensor import DTensor

    from tests.distributed.test_placement_effects import parallel_model

    cfg, setup, parallel = parallel_model(rank, world, ["mesh.tp_size=2", "mesh.dp_size=1",
                                                        "parallelism.sequence_parallel=true",
                                                        "trainer.loss=plain"] + LORA + extra)
    model = parallel.parts[0]
    names = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    def tp(p):  # the placement on the TP dim (the last of FSDP2 x TP): "R" or "S<dim>"
        q = p.placements[-1]
        return "R" if q.is_replicate() else f"S{q.dim}"

    layer = "model.layers.0."
    placed = {k: tp(names[layer + k]) for k in (
        "self_attn.q_proj.weight", "self_attn.q_proj.lora_A.weight",
        "self_attn.q_proj.lora_B.weight", "self_attn.o_proj.weight",
        "self_attn.o_proj.lora_A.weight", "self_attn.o_proj.lora_B.weight",
        "self_attn.q_proj.lora_magnitude_vector", "self_attn.o_proj.lora_magnitude_vector")
        if layer + k in names}
    trainable = sorted(n for n, p in names.items() if p.requires_grad)
    with torch.no_grad():  # (B from zero: A's gradient is zero in step 1)
        for n, p in names.items():
            if n.endswith("lora_B.weight"):
                p.add_(0.05)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for step in range(3):
        torch.manual_seed(step)
        ids = torch.randint(0, 256, (2, 32))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    replicas = {n: p.to_local().detach().clone() for n, p in names.items()
                if isinstance(p, DTensor) and ".lora_" in n and tp(p) == "R"}
    return placed, trainable, replicas


@pytest.mark.parametrize("dora", [False, True])
def test_tp_places_each_adapter_as_its_layer_and_keeps_replicas_equal(dora, tmp_path):
    from tests.helpers import run_on_ranks

    extra = ["peft.use_dora=true"] if dora else []
    (placed, trainable, replicas), (_, _, other) = run_on_ranks(_tp_adapters, 2, extra,
                                                                tmp_path=tmp_path)
    expected = {  # column-wise q_proj: A whole, B split like W; row-wise o_proj: A split
        "self_attn.q_proj.weight": "S0", "self_attn.q_proj.lora_A.weight": "R",  # like W,
        "self_attn.q_proj.lora_B.weight": "S0", "self_attn.o_proj.weight": "S1",  # B whole
        "self_attn.o_proj.lora_A.weight": "S1", "self_attn.o_proj.lora_B.weight": "R"}
    if dora:  # DoRA's lengths: split with the rows column-wise, whole row-wise
        expected.update({"self_attn.q_proj.lora_magnitude_vector": "S0",
                         "self_attn.o_proj.lora_magnitude_vector": "R"})
    assert placed == expected
    assert trainable and all(".lora_" in n for n in trainable)  # (SP's norms stay frozen)
    # A of 5 column-wise layers, B of 2 row-wise (and their magnitudes under DoRA), 4 blocks
    assert len(replicas) == 4 * (5 + 2 + (2 if dora else 0))
    for name, value in replicas.items():  # trained three steps, still the same on both ranks
        assert value.abs().max() > 0 and torch.equal(value, other[name]), name


def test_an_adapter_checkpoint_holds_no_buffer_and_no_frozen_alias(tmp_path):
    """Apertus keeps persistent buffers in its activation (``act_fn.beta``), Gemma ties its
    head to its embedding: the checkpoint of either holds the adapters and nothing else (no
    buffer, no frozen weight under a second name), and its optimizer state only theirs."""
    for model in ("apertus_tiny", "gemma_tiny"):
        train(["parallelism=none", f"model={model}", "trainer.max_steps=1",
               "checkpoint.every_steps=1"] + LORA, tmp_path / model)
        (saved,) = glob.glob(str(tmp_path / model / "checkpoints" / "*"))
        keys = [k for k in read_metadata(saved).state_dict_metadata if k.startswith("model.")]
        assert keys and all(".lora_" in k for k in keys), [k for k in keys if ".lora_" not in k]
