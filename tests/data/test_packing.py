"""Rows packed from several documents with ``data.pack_boundaries=true``: positions and
attention restart at each document, so a packed row trains as its documents would one by one
(padding-free equivalence, fp32)."""

import pytest
import torch

from automodel.data.batches import IGNORE_INDEX
from automodel.data.token_rows import TokenRows, restart_positions
from automodel.data.token_stream import TokenStream
from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, train


@pytest.mark.fast
def test_positions_and_labels_restart_at_documents():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12]]
    rows = TokenRows(TokenStream.from_documents(docs), seq_len=5, pack_boundaries=True)
    assert len(rows) == 2
    inputs, labels, extras = rows[torch.tensor([0, 1])].split()
    assert inputs.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]]
    # row 0 holds docs 0 and 1 and the start of doc 2; row 1 continues doc 2 (positions from 0)
    assert extras["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert labels.tolist() == [[2, 3, IGNORE_INDEX, 5, IGNORE_INDEX], [8, 9, 10, 11, 12]]
    assert restart_positions(torch.tensor([[True, False, True, True]])).tolist() == [[0, 1, 0, 0]]
    plain = TokenRows(TokenStream.from_documents(docs), seq_len=5)[torch.tensor([1])]
    assert isinstance(plain, torch.Tensor) and plain.tolist() == [[7, 8, 9, 10, 11, 12]]


FAMILIES = {  # a sliding window shorter than the row, so the packed mask meets the window
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3", head_dim=8),
    "mistral_window": dict(model_type="mistral", sliding_window=6),
}


# The packed and the apart gradients differ by rounding only: the largest difference beyond
# rtol (1e-5 x |grad|), measured over the three families with ATEN_CPU_CAPABILITY=default,
# avx2 and avx512 and 1 or 2 threads on an AVX-512 Xeon, was 4.4e-7 (avx2; gradients up to
# 5.4, whose float32 spacing is 4.8e-7); on an AVX2-only AMD EPYC one element differed by
# 1.22e-6. atol 1e-5 is 8x the largest seen, still 1e-5 of the largest gradient; a document
# that sees another's tokens moves the loss itself (checked below).
GRAD_ATOL = 1e-5


@pytest.mark.fast
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_packed_row_trains_as_its_documents_apart(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.loss import summed_cross_entropy
    from automodel.recipes.step import known_packing

    torch.manual_seed(0)
    config = AutoConfig.for_model(**FAMILIES[family], vocab_size=64, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    config.use_cache = False  # (as the runner builds models: a cache hides the packing)
    model = AutoModelForCausalLM.from_config(config).float()
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 64, (n,), generator=gen).tolist() for n in (7, 3, 12, 1, 9)]
    width = sum(map(len, docs))
    rows = TokenRows(TokenStream.from_documents(docs), seq_len=width - 1, pack_boundaries=True)
    inputs, labels, extras = rows[torch.tensor([0])].split()
    with known_packing(packed=True):
        packed = summed_cross_entropy(model(input_ids=inputs, **extras).logits, labels)
    packed.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apart = sum(summed_cross_entropy(model(input_ids=torch.tensor([d[:-1]])).logits,
                                     torch.tensor([d[1:]])) for d in docs if len(d) > 1)
    apart.backward()
    torch.testing.assert_close(packed, apart, rtol=1e-6, atol=1e-5)
    for mine, theirs in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=GRAD_ATOL)
    # and without the boundaries the documents would see each other: a different loss
    with known_packing():
        assert not torch.allclose(summed_cross_entropy(model(input_ids=inputs).logits, labels),
                                  apart)


PACKED = ["data.pack_boundaries=true"]


@pytest.mark.parametrize("layout", [
    ["parallelism=fsdp2", FP32, "mesh.dp_size=2", "trainer.local_batch_size=2"],
    ["parallelism=fsdp2", FP32, "mesh.tp_size=2", "parallelism.sequence_parallel=true"],
], ids=["fsdp2_dp2_accum", "tp2_sp"])
def test_packed_rows_in_parallel_match_one_rank(layout, reference, tmp_path):
    assert_matches(train(layout + PACKED, tmp_path), reference(*PACKED))


@pytest.mark.fast
def test_packing_refusals(tmp_path):
    from automodel.api import load_config
    from automodel.config.build import ConfigError

    for extra, match in [
        (["mesh.cp_size=2", "parallelism=fsdp2"], "mesh.cp_size=2: context parallel"),
        (["pipeline=1f1b", "mesh.pp_size=2", "parallelism=fsdp2"], "with a pipeline"),
        (["parallelism=fsdp2", "parallelism.patch_is_packed_sequence=true"],
         "patch_is_packed_sequence=true"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(["data=corpus"] + PACKED + extra, str(tmp_path))
