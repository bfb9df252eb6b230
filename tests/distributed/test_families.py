"""Hugging Face families beyond Llama under tensor and pipeline parallelism.

Each family is a tiny model built from its own config (``conf/model/<family>_tiny.yaml``):
other module names (GPT-NeoX, Phi), tied embeddings (Gemma, Gemma 2, StarCoder2), embedding
and logit multipliers in the model's own forward (Gemma, Granite), sliding-window layers
chosen by layer index (Gemma 2), and TP plans with gathered/split styles (OLMo 2, Phi-3),
multi-head latent attention (MiniCPM3: ``mla_kv_a_proj``) and per-head attention sinks split
as a bare parameter (Granite SWA: ``local_params``).
TP=2 (the family's own Hugging Face plan) and a 2-stage 1F1B pipeline must match the
single-process run of the same family in losses and gradient norms (fp32).

Ways of writing a model that the fake step and the stage split met first on families without
a preset (``benchmarks/families.py`` runs every family): attention that reshapes with its own
head counts under the Llama-style fallback plan (StableLM: the counts set to each TP rank's
share), an activation with weights between the split MLP projections (Apertus' xIELU: its
gradients summed over the TP ranks), and modules around the blocks that pipeline stages must
place: learned positions (GPT-2), a decoder one level down with learned positions (OPT), an
embedding norm and layers that return tuples (BLOOM, GPT-Neo: a stage passes the other stages'
layers in the same form), and a family that declares no ``_no_split_modules`` (BioGPT: its
blocks are the layer list's items). These have no TP plan of their own and other module names
than Llama's (refused under TP, docs/models.md), so they run under the pipeline only. BERT as
a decoder lists its embeddings among ``_no_split_modules`` while its word embedding is tied to
the LM head: under FSDP2 the tied weight stays in the root unit.
"""

import pytest

from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
from tests.helpers import FP32, train

FAMILIES = ["gpt_neox_tiny", "phi_tiny", "gemma_tiny", "gemma2_tiny", "olmo2_tiny",
            "phi3_tiny", "granite_tiny", "starcoder2_tiny", "minicpm3_tiny", "granite_swa_tiny"]
LAYOUTS = {
    "tp2": ["parallelism=fsdp2", FP32, "mesh.tp_size=2"],
    "pp2_1f1b": ["parallelism=fsdp2", FP32, "pipeline=1f1b", "pipeline.pp_microbatch_size=2"],
}
# (family, layout) beyond FAMILIES x LAYOUTS
WAYS = [("stablelm_tiny", "tp2"), ("apertus_tiny", "tp2"), ("gpt2_tiny", "pp2_1f1b"),
        ("opt_tiny", "pp2_1f1b"), ("bloom_tiny", "pp2_1f1b"), ("gpt_neo_tiny", "pp2_1f1b"),
        ("biogpt_tiny", "pp2_1f1b"), ("bert_decoder_tiny", "fsdp2")]
WAY_LAYOUTS = {**LAYOUTS, "fsdp2": ["parallelism=fsdp2", FP32]}


@pytest.mark.parametrize("family,layout",
                         [(f, lay) for f in FAMILIES for lay in sorted(LAYOUTS)] + WAYS)
def test_family_matches_single_process(family, layout, reference, tmp_path):
    records = train(WAY_LAYOUTS[layout] + [f"model={family}"], tmp_path)
    assert_matches(records, reference(f"model={family}"))


@pytest.mark.parametrize("family,schedule", [("gemma_tiny", "interleaved"),
                                             ("starcoder2_tiny", "v_schedule")])
def test_tied_embeddings_with_several_stages_per_rank(family, schedule, reference, tmp_path):
    # interleaved: the first and last stage on different ranks (a two-rank group sums the
    # shared weight's gradient); V placement: both on rank 0 (summed locally)
    records = train(["parallelism=fsdp2", FP32, f"pipeline={schedule}",
                     "pipeline.pp_microbatch_size=2", f"model={family}"], tmp_path)
    assert_matches(records, reference(f"model={family}"))


def test_tied_embeddings_pipeline_with_tp_and_fsdp(reference, tmp_path):
    # 8 ranks: pp 2 x dp 2 x tp 2; the tie groups pair ranks of the same (dp, tp) coordinate
    records = train(["parallelism=fsdp2", FP32, "pipeline=1f1b", "model=gemma_tiny",
                     "mesh.tp_size=2", "mesh.dp_size=2", "pipeline.pp_microbatch_size=1"],
                    tmp_path)
    assert_matches(records, reference("model=gemma_tiny"))


@pytest.mark.parametrize("family,layout", [
    ("stablelm_tiny", ["mesh.tp_size=2", "trainer.local_batch_size=2"]),  # 4 micro-batches
    ("gpt2_tiny", ["pipeline=1f1b", "pipeline.pp_microbatch_size=2"]),  # 4 micro-batches
])
def test_new_ways_train_under_the_default_precision(family, layout, reference, tmp_path):
    # the default mp_policy (bf16 parameters) with several micro-batches per step, against
    # the fp32 single process at the bf16 tolerance
    records = train(["parallelism=fsdp2", f"model={family}", *layout], tmp_path)
    assert_close_to_fp32(records, reference(f"model={family}"), loss_rtol=2e-2)
