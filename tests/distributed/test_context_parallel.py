"""Context parallelism: the sequence split over cp ranks (ring x Ulysses) trains exactly like
one process.

Every layout runs real gloo ranks (fp32) and must match the single-process run of the same
model and data in losses (rtol 1e-5) and gradient norms over 5 steps. Most runs use gradient
accumulation (``trainer.local_batch_size=2``: several micro-batches per step), so the loss
scale over dp x cp ranks and micro-batches is checked too.
"""

import pytest

from automodel.checkpoint.paths import checkpoint_path
from tests.distributed.test_checkpoint_layouts import assert_continues
from tests.distributed.test_golden import assert_golden
from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, train

FSDP2 = ["parallelism=fsdp2", FP32]
ACCUM = ["trainer.local_batch_size=2"]
QWEN3 = "model=qwen3_tiny"

# name: (layout overrides, model overrides the reference shares)
LAYOUTS = {
    # 2 ranks
    "cp2_ring": (["mesh.cp_size=2"] + ACCUM, []),
    "cp2_ulysses": (["mesh.cp_size=2", "mesh.cp_ulysses_size=2"] + ACCUM, [QWEN3]),
    # 4 ranks
    "cp4_2ring_x_2ulysses": (["mesh.cp_size=4", "mesh.cp_ulysses_size=2"] + ACCUM, [QWEN3]),
    "cp2_x_fsdp2_dp2": (["mesh.cp_size=2", "mesh.dp_size=2"] + ACCUM, []),
    "cp2_x_hsdp": (["mesh.cp_size=2", "mesh.dp_size=2", "mesh.dp_replicate_size=2"], [QWEN3]),
    "cp2_x_tp2_sequence_parallel": (["mesh.cp_size=2", "mesh.tp_size=2",
                                     "parallelism.sequence_parallel=true"] + ACCUM, [QWEN3]),
    # heads split by tp, then by ulysses (4 KV heads: 2 per TP rank, 1 per Ulysses rank)
    "cp2_ulysses_x_tp2": (["mesh.cp_size=2", "mesh.cp_ulysses_size=2", "mesh.tp_size=2"]
                          + ACCUM, ["model.config.num_key_value_heads=4"]),
    "cp2_x_pp2_1f1b": (["mesh.cp_size=2", "pipeline=1f1b", "pipeline.pp_microbatch_size=2"],
                       [QWEN3]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_context_parallel_matches_single_process(name, reference, tmp_path):
    layout, model = LAYOUTS[name]
    records = train(FSDP2 + layout + model, tmp_path)
    assert_matches(records, reference(*model))
    if name == "cp2_ring":  # also a golden run (tests/golden/, same name)
        assert_golden("cp2_ring", records, FSDP2 + layout + model)


def test_context_parallel_with_checkpointing_and_compile(reference, tmp_path):
    # selective activation checkpointing recomputes the attention exchange in backward;
    # per-layer compile runs around it
    records = train(FSDP2 + ["mesh.cp_size=2", "mesh.cp_ulysses_size=2",
                             "parallelism.activation_checkpointing=selective",
                             "parallelism.enable_compile=true", QWEN3], tmp_path)
    assert_matches(records, reference(QWEN3))


# Other attention shapes through the exchange: fused q/k/v with partial rotary (GPT-NeoX),
# multi-head latent attention with a value head size unlike the query's (MiniCPM3), q/k norms
# over all heads (OLMo 2), and a sliding window of 8 tokens (StarCoder2 passes its window to
# the attention function; the windowed mask is built from global positions).
@pytest.mark.parametrize("family", ["gpt_neox_tiny", "minicpm3_tiny", "olmo2_tiny",
                                    "starcoder2_tiny"])
def test_families_under_ring_and_ulysses(family, reference, tmp_path):
    extra = [f"model={family}"]
    if family == "starcoder2_tiny":
        extra.append("+model.config.sliding_window=8")
    records = train(FSDP2 + ["mesh.cp_size=4", "mesh.cp_ulysses_size=2"] + extra, tmp_path)
    assert_matches(records, reference(*extra))
    if family == "starcoder2_tiny":  # the window really changes the result
        unwindowed = reference(f"model={family}")
        assert abs(unwindowed[-1]["loss"] - records[-1]["loss"]) > 1e-3


RUN = ["trainer.max_steps=6", "checkpoint.every_steps=3"]


@pytest.mark.parametrize("source,target", [(["mesh.cp_size=2"], []),
                                           ([], ["mesh.cp_size=2", "mesh.cp_ulysses_size=2"])])
def test_checkpoint_resumes_across_context_parallel_layouts(source, target, tmp_path):
    # FSDP2 shards over dp x cp: a cp=2 checkpoint holds the same parameters sharded over two
    # ranks, and loads into one rank (dp 2 there), and the reverse
    cp1 = ["mesh.dp_size=2"]
    src = FSDP2 + RUN + (source or cp1)
    full = train(src, tmp_path / "full")
    train(src + ["trainer.stop_at_step=3"], tmp_path / "split")
    ckpt = checkpoint_path(str(tmp_path / "split" / "checkpoints"), 3)
    resumed = train(FSDP2 + RUN + (target or cp1) + [f"checkpoint.resume={ckpt}"],
                    tmp_path / "resumed")
    assert_continues(resumed, full)
