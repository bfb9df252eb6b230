"""Tensor and sequence parallelism: loss parity with a single process on real gloo ranks."""

import pytest

from tests.distributed.test_golden import assert_golden
from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, run_on_ranks, train

TP2 = ["parallelism=fsdp2", FP32, "mesh.tp_size=2"]
MLP_PLAN = ("parallelism.tp_plan={model.layers.*.mlp.gate_proj:colwise,"
            "model.layers.*.mlp.up_proj:colwise,model.layers.*.mlp.down_proj:rowwise}")


@pytest.mark.parametrize("name,overrides", [
    # llama_tiny has 4 query heads and 2 KV heads: TP=2 leaves one KV head per rank (GQA).
    ("tp2_hf_plan", TP2),
    ("tp2_sequence_parallel", TP2 + ["parallelism.sequence_parallel=true"]),
    ("tp2_yaml_plan", TP2 + [MLP_PLAN]),
    ("tp2_plan_dict_by_import_path",
     TP2 + ["parallelism.tp_plan=tests.distributed.plans.MLP_ONLY"]),
    ("tp2_plan_function_by_import_path",
     TP2 + ["parallelism.tp_plan=tests.distributed.plans.attention_only"]),
    ("tp2_async_on_cpu_trains_normally", TP2 + ["parallelism.enable_async_tensor_parallel=true"]),
])
def test_tp_matches_single_process(name, overrides, reference, tmp_path):
    records = train(overrides, tmp_path)
    assert_matches(records, reference())
    if name == "tp2_sequence_parallel":  # also a golden run (tests/golden/, same name)
        assert_golden("tp2_sequence_parallel", records, overrides)


def test_tp2_times_fsdp2_dp2_on_four_ranks(reference, tmp_path):
    records = train(TP2 + ["mesh.dp_size=2", "parallelism.sequence_parallel=true"], tmp_path)
    assert_matches(records, reference())


def test_qwen3_with_its_own_plan(reference, tmp_path):
    # Qwen3's plan has per-head q/k norms replicated with gradient all-reduce.
    records = train(TP2 + ["model=qwen3_tiny"], tmp_path)
    assert_matches(records, reference("model=qwen3_tiny"))


def test_tied_embeddings_tp_and_fsdp2(reference, tmp_path):
    tied = "model.config.tie_word_embeddings=true"
    records = train(TP2 + ["mesh.dp_size=2", tied, "parallelism.sequence_parallel=true"],
                    tmp_path)
    assert_matches(records, reference(tied))


def test_per_layer_compile_with_tp(reference, tmp_path):
    # Compiled TP layers switch sequence parallelism on (see test_resolve); parity holds.
    records = train(TP2 + ["parallelism.enable_compile=true"], tmp_path)
    assert_matches(records, reference())


# ----------------------------------------------------------------------------- technique level
def _tied_after_parallelize(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel.config.schema import FSDP2Config, ModelConfig
    from automodel.distributed.fsdp2 import apply_fsdp2
    from automodel.distributed.mesh import MeshAxis, build_mesh
    from automodel.distributed.tensor_parallel import apply_tp
    from automodel.models.builder import build_model
    from automodel.models.parts import block_fqns
    from automodel.models.tp_plans import select_tp_plan

    mesh = build_mesh("cpu", "gloo", 1, pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    cfg = ModelConfig(config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                              "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2,
                              "tie_word_embeddings": True})
    model = build_model(cfg, seed=0)
    plan, source = select_tp_plan(model, None)
    blocks = block_fqns(model)
    apply_tp(model, mesh[MeshAxis.TP], plan, source, blocks, True, False)
    tied_after_tp = model.lm_head.weight is model.model.embed_tokens.weight
    apply_fsdp2(model, blocks, mesh[MeshAxis.DP_SHARD_CP], FSDP2Config(), MixedPrecisionPolicy(),
                None)
    tied_after_fsdp = model.lm_head.weight is model.model.embed_tokens.weight
    n_params = len(list(model.parameters()))
    placements = [(type(p).__name__, p.dim) for p in model.model.embed_tokens.weight.placements]
    return tied_after_tp, tied_after_fsdp, n_params, placements


def test_tied_embeddings_stay_one_parameter(tmp_path):
    for tied_tp, tied_fsdp, n_params, placements in run_on_ranks(
            _tied_after_parallelize, 4, tmp_path=tmp_path):
        assert tied_tp and tied_fsdp
        assert n_params == 1 + 2 * 9 + 1  # embedding (shared with lm_head), 2 blocks, final norm
        # vocab rows sharded over tp, and those shards again over dp (FSDP's strided shard)
        assert placements == [("_StridedShard", 0), ("Shard", 0)]


class _NormedEmbedding:  # (built inside the ranks: torch imported there)
    @staticmethod
    def make(vocab, dim):
        import torch
        from torch import nn

        class NormedEmbedding(nn.Embedding):  # a norm inside the embedding (as Inkling's)
            def __init__(self):
                super().__init__(vocab, dim)
                self.embed_norm = nn.LayerNorm(dim)

            def forward(self, ids):
                return self.embed_norm(super().forward(ids))

        torch.manual_seed(0)
        return NormedEmbedding()


def _normed_embedding_split(rank, world, style, sequence_parallel):
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from automodel.distributed.mesh import MeshAxis, build_mesh
    from automodel.distributed.tensor_parallel import _style

    mesh = build_mesh("cpu", "gloo", 1, pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2)
    ref, emb = _NormedEmbedding.make(16, 8), _NormedEmbedding.make(16, 8)
    ids = torch.tensor([[1, 9, 15, 3]])
    expected = ref(ids)
    expected.sum().backward()
    parallelize_module(emb, mesh[MeshAxis.TP],
                       _style(style, emb, sequence_parallel, False))
    out = emb(ids)
    full = out.full_tensor() if isinstance(out, DTensor) else out
    full.sum().backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in emb.named_parameters()}
    placements = {n: [type(q).__name__ for q in p.placements] for n, p in emb.named_parameters()}
    ref_grads = dict((n, p.grad) for n, p in ref.named_parameters())
    return (torch.allclose(full, expected, atol=1e-6), placements,
            {n: torch.allclose(grads[n], ref_grads[n], atol=1e-6) for n in grads})


@pytest.mark.parametrize("style,sequence_parallel", [
    ("embedding_rowwise", False), ("embedding_rowwise", True), ("embedding_colwise", False)])
def test_an_embedding_with_a_norm_inside_splits_only_its_table(style, sequence_parallel,
                                                               tmp_path):
    # torch's embedding styles split every parameter of the module (the norm's too, and fail
    # registering "embed_norm.weight"); the norm sees the whole lookup: the row-wise masked
    # lookup's partial sums reduced once, the column-wise lookup's features gathered (a norm
    # over a rank's half of the features would be silently wrong)
    for same, placements, grads_match in run_on_ranks(
            _normed_embedding_split, 2, style, sequence_parallel, tmp_path=tmp_path):
        assert same and all(grads_match.values()), grads_match
        assert placements == {"weight": ["Shard"], "embed_norm.weight": ["Replicate"],
                              "embed_norm.bias": ["Replicate"]}


def _bad_plan(rank, world, plan):
    from automodel.config.schema import ModelConfig
    from automodel.distributed.mesh import MeshAxis, build_mesh
    from automodel.distributed.tensor_parallel import apply_tp
    from automodel.models.builder import build_model
    from automodel.models.parts import block_fqns

    mesh = build_mesh("cpu", "gloo", 1, pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2)
    model = build_model(ModelConfig(config={"model_type": "llama", "vocab_size": 64,
                                            "hidden_size": 32, "intermediate_size": 64,
                                            "num_hidden_layers": 2, "num_attention_heads": 2,
                                            "num_key_value_heads": 2}), seed=0)
    try:
        apply_tp(model, mesh[MeshAxis.TP], plan, "parallelism.tp_plan", block_fqns(model),
                 False, False)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("plan,expected", [
    ({"model.layers.*.mlp.up_proj": "colwize"}, "style 'colwize'"),
    ({"model.layers.*.mlp.upper_proj": "colwise"}, "pattern 'model.layers.*.mlp.upper_proj' "
                                                   "matches no module"),
])
def test_bad_plans_name_the_pattern(plan, expected, tmp_path):
    messages = run_on_ranks(_bad_plan, 2, plan, tmp_path=tmp_path)
    assert all(expected in m for m in messages), messages


def test_hsdp_times_tp_on_a_3d_mesh_of_eight_ranks(reference, tmp_path):
    records = train(["parallelism=hsdp", FP32, "mesh.tp_size=2", "trainer.local_batch_size=1",
                     "parallelism.sequence_parallel=true"], tmp_path)
    assert_matches(records, reference())


def test_qwen2_with_its_own_plan(reference, tmp_path):
    # Qwen2 (biased q/k/v projections) from config, sharded by its own HF plan.
    qwen2 = "model.config.model_type=qwen2"
    records = train(TP2 + [qwen2, "parallelism.sequence_parallel=true"], tmp_path)
    assert_matches(records, reference(qwen2))
