"""The LM head fused with the loss (``trainer.loss``): the same losses and gradients as the
plain loss over the model's logits, for every shipped family and in the parallel layouts
(tensor parallelism keeps the head split over the vocabulary)."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from automodel.loss import linear_cross_entropy, summed_cross_entropy
from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, train


@pytest.mark.fast
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_head_and_loss_equal_the_plain_loss(bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 101, bias=bias)
    hidden = torch.randn(3, 37, 16, requires_grad=True)
    labels = torch.randint(0, 101, (3, 37))
    labels[0, :5] = -100  # ignored tokens
    plain = summed_cross_entropy(head(hidden), labels)
    plain.backward()
    want = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    hidden.grad = None
    head.zero_grad()
    fused = linear_cross_entropy(hidden, head.weight, head.bias, labels, chunk=10)
    (fused * 0.5).backward()  # the runner scales the summed loss
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    got = [hidden.grad] + [p.grad for p in head.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w * 0.5, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(linear_cross_entropy(hidden, head.weight, head.bias, labels,
                                                        chunk=7), plain, rtol=1e-6, atol=0)


@pytest.mark.fast
def test_hidden_states_in_another_dtype_than_the_head_are_cast_to_its_dtype():
    # (Falcon-Mamba's float32 residual stream under bfloat16 weights: the head of the model
    # casts the hidden states to its weight's dtype; the fused loss does the same)
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 101, bias=False).to(torch.bfloat16)
    hidden = torch.randn(2, 9, 16, requires_grad=True)  # float32
    labels = torch.randint(0, 101, (2, 9))
    fused = linear_cross_entropy(hidden, head.weight, None, labels, chunk=4)
    fused.backward()
    plain = summed_cross_entropy(head(hidden.detach().to(torch.bfloat16)), labels)
    torch.testing.assert_close(fused, plain, rtol=1e-2, atol=0)
    assert hidden.grad.dtype == torch.float32 and hidden.grad.abs().max() > 0


# (the tiny presets: the real-size ones, llama3_1_8b ... deepseek_v3, are never built with
# weights in a test)
PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "model").glob(
    "*_tiny.yaml"))


@pytest.mark.fast
@pytest.mark.parametrize("preset", PRESETS)
def test_every_family_fuses_exactly_or_says_why_not(preset):
    from automodel.distributed.fused_head import apply_fused_head, fused_head_problem
    from tests.distributed.test_image_text import _meta

    config = _meta(preset).config
    from automodel.models.multimodal import auto_class, text_config

    torch.manual_seed(0)
    model = auto_class(config).from_config(config).float()
    model.config.use_cache = False
    text_config(model.config).use_cache = False
    problem = fused_head_problem(model)
    if problem is not None:  # (soft-capped or scaled logits): auto keeps the plain loss
        assert apply_fused_head(model, "auto", 16) is None
        with pytest.raises(ValueError, match=re.escape(problem)):
            apply_fused_head(model, "fused", 16)
        return
    vocab = text_config(config).vocab_size
    ids = torch.randint(0, min(vocab, 250), (2, 24))
    labels = torch.roll(ids, -1, 1)
    plain = summed_cross_entropy(model(input_ids=ids).logits, labels)
    plain.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    loss = apply_fused_head(model, "auto", 16)
    fused = loss(model(input_ids=ids).logits, labels)
    fused.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    norm = torch.stack([g.norm() for g in want.values()]).norm()
    torch.testing.assert_close(torch.stack([g.norm() for g in got.values()]).norm(), norm,
                               rtol=1e-6, atol=0)
    for name in want:  # each gradient, relative to the whole gradient's norm
        assert (got[name] - want[name]).norm() <= 1e-6 * norm, name


@pytest.mark.fast  # one process, no process group
def test_fused_loss_trains_as_the_plain_loss(reference, tmp_path):
    # the single-process reference uses the fused loss (trainer.loss=auto): it must match the
    # plain loss over the model's logits step by step
    plain = train(["parallelism=none", "trainer.loss=plain"], tmp_path / "plain")
    fused = reference()
    np.testing.assert_allclose([r["loss"] for r in fused], [r["loss"] for r in plain],
                               rtol=1e-6)
    np.testing.assert_allclose([r["grad_norm"] for r in fused],
                               [r["grad_norm"] for r in plain], rtol=1e-5)


@pytest.mark.parametrize("layout", [
    ["mesh.tp_size=2", "parallelism.sequence_parallel=true"],
    ["mesh.tp_size=2", "mesh.pp_size=2", "pipeline=1f1b", "pipeline.pp_microbatch_size=2",
     "model.config.tie_word_embeddings=true"],
], ids=["tp2_sp_vocab_parallel", "tp2_pp2_tied"])
def test_fused_loss_in_tensor_parallel_layouts(layout, reference, tmp_path):
    extra = [x for x in layout if x.startswith("model.")]
    records = train(["parallelism=fsdp2", FP32] + layout, tmp_path)
    assert_matches(records, reference(*extra))
