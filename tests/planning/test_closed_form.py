"""Closed-form activation, model-state and FLOP counts (``automodel/planning/closed_form.py``)
on numbers worked by hand from the formulas, and one check of the planner's simulated
per-layer activations against them."""

from __future__ import annotations

import pytest

from automodel.planning.closed_form import (
    Dense,
    korthikanti_layer_bytes,
    llama_layer_bytes,
    megatron_state_bytes,
    model_state_bytes,
    training_flops,
)

# Llama 3.1 8B's published sizes
LLAMA_8B = Dense(hidden=4096, ffn=14336, heads=32, kv_heads=8, layers=32, vocab=128256)


@pytest.mark.fast
def test_korthikanti_table2_by_hand():
    # GPT-3 175B's layer in the paper: s 2048, h 12288, a 96; sbh = 25,165,824, 5as/h = 80
    s, b, h, a = 2048, 1, 12288, 96
    assert korthikanti_layer_bytes(s, b, h, a) == 114 * 25_165_824  # sbh(34 + 5as/h)
    assert korthikanti_layer_bytes(s, b, h, a, t=8) == 23 * 25_165_824  # sbh(10+24/t+5as/ht)
    assert korthikanti_layer_bytes(s, b, h, a, t=8, sp=True) == 114 * 25_165_824 / 8
    assert korthikanti_layer_bytes(s, b, h, a, t=8, sp=True, ac="selective") == \
        34 * 25_165_824 / 8
    assert korthikanti_layer_bytes(s, b, h, a, t=8, ac="selective") == 13 * 25_165_824
    assert korthikanti_layer_bytes(s, b, h, a, t=8, sp=True, ac="full") == 2 * 25_165_824
    assert korthikanti_layer_bytes(s, b, h, a, scores=False) == 34 * 25_165_824
    with pytest.raises(ValueError, match="'some'"):
        korthikanti_layer_bytes(s, b, h, a, ac="some")
    with pytest.raises(ValueError, match="degree 0"):
        llama_layer_bytes(LLAMA_8B, s, b, t=0)


@pytest.mark.fast
def test_llama_layer_by_hand():
    # s 1024, b 1: sbh = 4,194,304, sbf = 14,680,064; GQA: k and v are a quarter of q
    sbh, sbf, sb = 4_194_304, 14_680_064, 1024
    norms = 2 * (4 * sbh + 4 * sb + 2 * sbh)  # fp32 input, fp32 rsqrt, bf16 normed input
    attention = 2 * sbh + 2 * sbh * 1.5 + 2 * sbh + 4 * 32 * 1024  # input, q k v, out, lse
    mlp = 2 * sbh + 4 * 2 * sbf  # input, gate, up, silu(gate), product
    assert norms + attention + mlp == 205_660_160
    assert llama_layer_bytes(LLAMA_8B, 1024, 1) == 205_660_160
    # TP 2 + SP: norms sharded, block inputs gathered whole, the rest split
    assert llama_layer_bytes(LLAMA_8B, 1024, 1, t=2, sp=True) == \
        norms / 2 + 2 * sbh + (2 * sbh * 1.5 + 2 * sbh + 4 * 32 * 1024) / 2 + 2 * sbh + \
        4 * 2 * sbf / 2 == 111_218_688
    # selective (matmul and attention outputs kept), s 4096: sbh 16,777,216, sbf 58,720,256
    assert llama_layer_bytes(LLAMA_8B, 4096, 1, ac="selective") == \
        2 * 16_777_216 * (1 + 1.5 + 1 + 2) + 4 * 32 * 4096 + 4 * 58_720_256 == 419_954_688
    assert llama_layer_bytes(LLAMA_8B, 1024, 1, t=2, sp=True, ac="full") == sbh  # 2sbh/t
    assert llama_layer_bytes(LLAMA_8B, 1024, 1, t=2, ac="full") == 2 * sbh


@pytest.mark.fast
def test_model_states_and_flops_by_hand():
    assert LLAMA_8B.parameters() == 8_030_261_248  # Llama 3.1 8B's published count
    states = model_state_bytes(8_000, shards=8)
    assert states == {"parameters": 2_000, "gradients": 2_000, "optimizer_states": 4_000}
    assert model_state_bytes(8_000, 8, param_bytes=4)["optimizer_states"] == 8_000
    assert megatron_state_bytes(1_000, dp=1, distributed_optimizer=False) == 18_000
    assert megatron_state_bytes(1_000, dp=4) == 9_000  # 6 + 12/4
    m = Dense(hidden=8, ffn=16, heads=2, kv_heads=1, layers=2, vocab=10)
    # per layer: q, o 64 each; k, v 32 each (kv_dim 4); gate, up, down 128 each: 576
    assert m.layer_matmul_parameters() == 576
    assert m.matmul_parameters() == 2 * 576 + 80  # + the LM head
    # per token: 6 x 1232 + attention 12 L h s / 2 (causal) = 7392 + 384, s = 4
    assert training_flops(m, 4, tokens=4) == 4 * (7392 + 384)
    assert training_flops(m, 4, tokens=4, causal=False) == 4 * (7392 + 768)
    assert training_flops(m, 4, 4, flash_backward=True) == 4 * (7392 + 448)  # 14 L h s / 2
    # full recompute: the blocks' matmuls and attention forward again (+ 2 x 1152 + 128)
    assert training_flops(m, 4, 4, ac="full") == 4 * (7392 + 384 + 2304 + 128)
    # early stop: down_proj (h x f = 128) is not rerun
    assert training_flops(m, 4, 4, ac="full", early_stop=True) == \
        4 * (7392 + 384 + 2 * 2 * (576 - 128) + 128)


def test_plan_layer_activation_matches_the_llama_count():
    """The planner's one-layer activation bytes (Llama 3.1 8B's shape at 2 and 3 layers,
    FSDP 2 x TP 2 + SP, AC none, seq 1024) against the count of saved tensors: equal to
    within 1% (the formula lists every tensor autograd saves in the block; what it leaves
    out would show here), and 1.4-1.7x the paper's TP+SP formula without its score term
    (34sbh/t): the SwiGLU MLP (8sbf/t with f = 3.5h, where the paper has 19sbh/t), RMSNorm's
    fp32 copy of its input, and torch's TP keeping the gathered inputs of the attention and
    the MLP whole (4sbh) where Megatron keeps them sharded."""
    from automodel.api import load_config
    from automodel.planning.plan import simulate_configs

    def cfg(depth):
        return load_config(["model=llama3_1_8b", "data=synthetic", "parallelism=fsdp2",
                            "pipeline=none", "mesh.dp_size=2", "mesh.tp_size=2",
                            "parallelism.sequence_parallel=true",
                            "parallelism.activation_checkpointing=false",
                            "trainer.global_batch_size=2", "trainer.local_batch_size=1",
                            "trainer.seq_len=1024", f"++model.config.num_hidden_layers={depth}"],
                           env={"CUDA_VISIBLE_DEVICES": ""})

    shallow, deep = simulate_configs([cfg(2), cfg(3)], [0, 0], workers=2)
    layer = deep["memory"]["activations"] - shallow["memory"]["activations"]
    state = sum(deep["memory"][k] - shallow["memory"][k]
                for k in ("parameters_sharded", "optimizer_states"))
    assert deep["peak_bytes"] - shallow["peak_bytes"] - state == layer  # peak in backward
    formula = llama_layer_bytes(LLAMA_8B, 1024, 1, t=2, sp=True)
    assert layer == pytest.approx(formula, rel=0.01)
    paper = korthikanti_layer_bytes(1024, 1, 4096, 32, t=2, sp=True, scores=False)
    assert 1.4 < layer / paper < 1.7
