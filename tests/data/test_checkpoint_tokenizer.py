"""``model.pretrained_path=DIR`` without ``data.tokenizer_path``: text sources tokenize with
DIR's own tokenizer when DIR holds one, are refused before launch when it does not (and the
model's vocabulary is not byte-level), and an explicit ``data.tokenizer_path`` still wins."""

import json

import numpy as np
import pytest
import torch

from automodel.config.build import ConfigError
from automodel.data.batches import BatchPlan
from automodel.data.corpus import generate_documents
from automodel.data.token_cache import tokenizer_identity
from tests.data.test_data import _save_word_tokenizer
from tests.data.test_hf_data import _save_dataset
from tests.helpers import TRAINER, train


def _save_model(path, vocab_size):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=vocab_size, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(the documents, a JSONL file of them, a saved dataset of them, a folder)."""
    root = tmp_path_factory.mktemp("ckpt_tok")
    docs = generate_documents(120, 3)
    with open(root / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return docs, str(root / "docs.jsonl"), _save_dataset(root / "ds", docs), root


def _expected_ids(tokenizer, docs):
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    return np.concatenate([np.asarray(d + [tokenizer.eos_token_id]) for d in ids])


def _sources(corpus, tmp_path):
    _, jsonl, ds, _ = corpus
    return {"files": ["data=files", f"data.paths=[{jsonl}]"],
            "hf": ["data=hf", f"data.path={ds}", f"data.cache_dir={tmp_path / 'cache'}"]}


@pytest.mark.fast  # one process, no process group
def test_the_checkpoints_tokenizer_is_the_default(corpus, tmp_path):
    from automodel.api import load_config
    from automodel.data.sources import training_data

    docs, _, _, _ = corpus
    ckpt = _save_model(tmp_path / "ckpt", 1024)
    tokenizer = _save_word_tokenizer(ckpt, docs)  # the checkpoint's own tokenizer, in DIR
    expected = _expected_ids(tokenizer, docs)
    assert len(expected) < len("".join(docs)) / 2  # (words, not bytes)
    for source, overrides in _sources(corpus, tmp_path).items():
        cfg = load_config(["parallelism=none", "model=pretrained",
                           f"model.pretrained_path={ckpt}", "trainer.seq_len=16",
                           "trainer.global_batch_size=4", *overrides], str(tmp_path / source))
        assert cfg.data.tokenizer_path == ckpt, source
        rows, _ = training_data(cfg.data_source, cfg.data, cfg.trainer.seq_len, cfg.model)
        [(inputs, labels)] = BatchPlan(rows, 4, cfg.trainer.seed).micro_batches(0, 0, 1, 4)
        windows = {tuple(expected[i:i + 17]) for i in range(0, len(expected) - 16, 17)}
        for inp, lab in zip(inputs.tolist(), labels.tolist()):  # each row: a 17-token window
            assert tuple(inp + lab[-1:]) in windows, source
    # A run says which tokenizer it uses, and trains on those ids
    records = train(["parallelism=none", "model=pretrained", f"model.pretrained_path={ckpt}",
                     "trainer.max_steps=1", *_sources(corpus, tmp_path)["files"]],
                    tmp_path / "run", base=TRAINER)
    assert records[0]["step"] == 1
    assert f"tokenizer {ckpt}" in (tmp_path / "run" / "train.log").read_text()
    # The token cache's key reads the tokenizer's files in DIR, not the weights beside them
    key = tokenizer_identity(ckpt)
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"other weights")
    assert tokenizer_identity(ckpt) == key


@pytest.mark.fast
def test_bytes_for_a_checkpoint_without_a_tokenizer_are_refused(corpus, tmp_path):
    from automodel.api import load_config

    ckpt = _save_model(tmp_path / "ckpt", 1024)  # no tokenizer files in DIR
    for overrides in _sources(corpus, tmp_path).values():
        with pytest.raises(ConfigError, match=r"data.tokenizer_path is not set.*1024"):
            load_config(["model=pretrained", f"model.pretrained_path={ckpt}", *overrides],
                        str(tmp_path))
    # A byte-level checkpoint (e.g. one trained here on bytes and exported) still takes them
    small = _save_model(tmp_path / "small", 256)
    cfg = load_config(["model=pretrained", f"model.pretrained_path={small}",
                       *_sources(corpus, tmp_path)["files"]], str(tmp_path))
    assert cfg.data.tokenizer_path is None


@pytest.mark.fast
def test_an_explicit_tokenizer_path_wins(corpus, tmp_path):
    from automodel.api import load_config
    from automodel.data.sources import token_stream

    docs, _, _, _ = corpus
    ckpt = _save_model(tmp_path / "ckpt", 1024)
    _save_word_tokenizer(ckpt, docs[:20])  # a smaller vocabulary than the one asked for
    other = _save_word_tokenizer(tmp_path / "other", docs)
    for source, overrides in _sources(corpus, tmp_path).items():
        cfg = load_config(["model=pretrained", f"model.pretrained_path={ckpt}",
                           f"data.tokenizer_path={tmp_path / 'other'}", *overrides],
                          str(tmp_path / source))
        assert cfg.data.tokenizer_path == str(tmp_path / "other")
        stream = token_stream(source, cfg.data)
        np.testing.assert_array_equal(np.asarray(stream.tokens), _expected_ids(other, docs))
