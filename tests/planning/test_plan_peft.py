"""The planner plans adapters (``peft=lora``): the simulated step has the adapters, the frozen
base takes no gradient and no optimizer state, FSDP2 reduce-scatters the adapters' gradients
only, and the backward skips the frozen weights' gradient matmuls."""

import pytest

from automodel.api import load_config
from automodel.costing.gpus import profile
from automodel.planning.plan import make_plan


def _plan(*extra):
    cfg = load_config(["parallelism=fsdp2", "mesh.dp_size=2", "data=synthetic", *extra])
    return make_plan(cfg, profile("h100_80gb"), workers=1)


def test_a_lora_plan_has_the_adapters_states_and_gradients_only():
    full, lora = _plan(), _plan("peft=lora")
    adapters = lora["model"]["trainable_parameters"]
    # llama_tiny, rank 8: q, o (64 -> 64), k, v (64 -> 32), gate, up, down (64 <-> 176), 4 blocks
    assert adapters == 4 * 8 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 176))
    assert lora["model"]["parameters"] == full["model"]["parameters"] + adapters
    (rank,), (rank_full,) = lora["ranks"], full["ranks"]
    per_rank = adapters // 2 * 4  # float32, sharded over dp 2
    # AdamW's two states of the adapters' shard, and its step counts (0-dim)
    assert 2 * per_rank <= rank["memory"]["optimizer_states"] < 2 * per_rank + 1024
    assert rank_full["memory"]["optimizer_states"] > 5 * rank["memory"]["optimizer_states"]
    rs = lambda p: p["comm_bytes_per_step"]["dp_shard"]["reduce_scatter"]  # noqa: E731
    assert rs(lora) == adapters * 4 and rs(full) == full["model"]["parameters"] * 4
    assert lora["flops_per_step"] < full["flops_per_step"]  # (no weight gradients of the base)


@pytest.mark.parametrize("layout", [["mesh.tp_size=2", "parallelism.sequence_parallel=true"],
                                    ["pipeline=1f1b", "pipeline.pp_microbatch_size=2"]])
def test_lora_layouts_plan(layout):
    plan = _plan("peft=lora", *layout)
    assert all(r["fits"] for r in plan["ranks"])
    assert "peft=lora" in plan["command"]


def test_a_qlora_plan_keeps_the_adapted_weights_at_their_4_bit_size():
    nf4 = ("peft.nf4_scaler_block_size=8",)
    lora, qlora = _plan("peft=lora"), _plan("peft=qlora", *nf4)
    sharded = lambda p: p["ranks"][0]["memory"]["parameters_sharded"]  # noqa: E731
    # the 28 adapted weights (4 blocks x 7), each split in 2 rows of shards: the frozen base
    # in bfloat16 (the default policy's compute dtype: 2 bytes a value) against NF4: half a
    # byte a value, a scale byte per 64 values, a factor per group of 8 x 64, and in every
    # shard the mean of the scales and the 16 levels (the factors, mean and levels in the
    # weight's own dtype, bfloat16)
    sizes = 4 * [64 * 64, 32 * 64, 32 * 64, 64 * 64, 176 * 64, 176 * 64, 64 * 176]
    nf4_bytes = sum(n // 2 // 2 + n // 64 // 2 + 2 * n // 512 // 2 + 2 + 16 * 2 for n in sizes)
    assert sharded(lora) - sharded(qlora) == sum(2 * n // 2 for n in sizes) - nf4_bytes
    ag = lambda p: p["comm_bytes_per_step"]["dp_shard"]["all_gather"]  # noqa: E731
    assert ag(qlora) < ag(lora)  # (the gathers carry the 4-bit bytes)
    assert qlora["model"]["trainable_parameters"] == lora["model"]["trainable_parameters"]
    assert "peft=qlora" in qlora["command"]


def test_the_frozen_base_is_planned_in_peft_base_dtype():
    """The base is stored in the compute dtype (bfloat16 under the default policy) unless
    ``peft.base_dtype`` says otherwise: half the weights' bytes of a float32 base, the
    adapters (float32) and their states as they were."""
    bf16, fp32 = _plan("peft=lora"), _plan("peft=lora", "peft.base_dtype=float32")
    base = bf16["model"]["parameters"] - bf16["model"]["trainable_parameters"]
    sharded = lambda p: p["ranks"][0]["memory"]["parameters_sharded"]  # noqa: E731
    assert sharded(fp32) - sharded(bf16) == base * 2 // 2  # (2 bytes less a value, dp 2)
    states = lambda p: p["ranks"][0]["memory"]["optimizer_states"]  # noqa: E731
    assert states(fp32) == states(bf16)
    assert fp32["ranks"][0]["peak_bytes"] > bf16["ranks"][0]["peak_bytes"]
