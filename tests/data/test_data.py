"""Data sources and the per-step batch plan."""

import json

import numpy as np
import pytest
import torch

from automodel.config.schema import CorpusDataConfig, FilesDataConfig, SyntheticDataConfig
from automodel.data.batches import BatchPlan
from automodel.data.corpus import generate_documents
from automodel.data.sources import token_sequences
from tests.helpers import TRAINER, train


@pytest.mark.fast
def test_corpus_is_deterministic_and_seeded():
    assert generate_documents(50, 3) == generate_documents(50, 3)
    assert generate_documents(50, 3) != generate_documents(50, 4)
    seqs = token_sequences("corpus", CorpusDataConfig(num_documents=200), 32, 256)
    assert seqs.shape[1] == 33 and seqs.max() < 128  # ASCII bytes


@pytest.mark.fast
def test_synthetic_respects_vocab_and_seed():
    a = token_sequences("synthetic", SyntheticDataConfig(num_sequences=10, vocab_size=7), 8, 256)
    b = token_sequences("synthetic", SyntheticDataConfig(num_sequences=10, vocab_size=7), 8, 256)
    assert torch.equal(a, b) and a.shape == (10, 9) and a.max() < 7


@pytest.mark.fast
def test_batch_plan_is_layout_independent():
    seqs = torch.arange(40 * 5).view(40, 5)
    plan = BatchPlan(seqs, global_batch_size=8, seed=0)
    for step in (0, 4, 9):  # step 9 is in the second epoch
        whole = torch.cat([x for x, _ in plan.micro_batches(step, 0, 1, 8)])
        split = torch.cat([x for rank in range(4) for x, _ in plan.micro_batches(step, rank, 4, 1)])
        assert torch.equal(whole, split)
        inputs, labels = plan.micro_batches(step, 0, 1, 8)[0]
        assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are the next tokens
    assert not torch.equal(plan.global_batch(0), plan.global_batch(5))  # reshuffled per epoch


@pytest.mark.fast
def test_files_txt_and_jsonl_byte_level(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\n\nsecond doc\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "third"}) + "\n")
    seqs = token_sequences("files", FilesDataConfig(paths=[str(tmp_path / "a.txt"),
                                                           str(tmp_path / "b.jsonl")]), 4, 256)
    text = bytes(seqs.flatten().tolist()).decode()
    assert text == "first doc\nsecond doc\nthird\n"[:25]  # 5 whole rows of 5 bytes
    with pytest.raises(ValueError, match="'body'"):
        token_sequences("files", FilesDataConfig(paths=[str(tmp_path / "b.jsonl")],
                                                 text_key="body"), 4, 256)


def _save_word_tokenizer(path, docs):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(path)
    return fast


@pytest.mark.fast  # one process, no process group
def test_local_files_with_a_local_tokenizer_train(tmp_path):
    docs = generate_documents(300, 1)
    tokenizer = _save_word_tokenizer(tmp_path / "tok", docs)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    seqs = token_sequences("files", FilesDataConfig(paths=[str(tmp_path / "docs.jsonl")],
                                                    tokenizer_path=str(tmp_path / "tok")), 16, 256)
    assert seqs.max() < len(tokenizer) and (seqs == tokenizer.eos_token_id).any()
    overrides = ["parallelism=none", "data=files", f"data.paths=[{tmp_path}/docs.jsonl]",
                 f"data.tokenizer_path={tmp_path}/tok", "trainer.max_steps=8",
                 "model.config.vocab_size=128"]
    records = train(overrides, tmp_path / "run", base=TRAINER)
    # The run trained on these tokens: its first step's loss and gradient norm are those of
    # the initial model on the first global batch of the tokenized files, in plain torch
    loss, grad_norm = _first_step_in_plain_torch(TRAINER + overrides, tmp_path / "plain")
    assert records[0]["step"] == 1
    np.testing.assert_allclose(records[0]["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(records[0]["grad_norm"], grad_norm, rtol=1e-4)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5


def _first_step_in_plain_torch(overrides, output_dir):
    """(loss, gradient norm) of step 1 of the job ``overrides``, computed here in one process
    from the job's data rows and initial model: mean token cross-entropy over the first
    global batch, and the norm of its gradient."""
    from automodel.api import load_config
    from automodel.data.sources import training_data
    from automodel.models.builder import build_model

    cfg = load_config(overrides, str(output_dir))
    t = cfg.trainer
    rows, _ = training_data(cfg.data_source, cfg.data, t.seq_len, cfg.model)
    [(inputs, labels)] = BatchPlan(rows, t.global_batch_size, t.seed).micro_batches(
        0, 0, 1, t.global_batch_size)
    model = build_model(cfg.model, t.seed)
    logits = model(input_ids=inputs, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    norms = [torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None]
    return loss.item(), torch.linalg.vector_norm(torch.stack(norms)).item()


@pytest.mark.fast
def test_tokenizer_larger_than_the_model_vocab_is_a_clear_error(tmp_path):
    _save_word_tokenizer(tmp_path / "tok", generate_documents(300, 1))
    (tmp_path / "d.txt").write_text("\n\n".join(generate_documents(50, 2)))
    with pytest.raises(ValueError, match="model.config.vocab_size"):
        token_sequences("files", FilesDataConfig(paths=[str(tmp_path / "d.txt")],
                                                 tokenizer_path=str(tmp_path / "tok")), 16, 8)
