"""``data=hf`` and ``data=tokens``: local datasets built in the test (``datasets`` objects saved
to disk, parquet files, .npy token arrays), the token cache, evaluation and resume."""

import os

import numpy as np
import pytest
import torch

from automodel.config.schema import HFDataConfig, TokensDataConfig
from automodel.data.corpus import generate_documents
from tests.helpers import FP32, TRAINER, train


def _save_dataset(path, docs, eval_docs=None, field="text"):
    import datasets

    splits = {"train": datasets.Dataset.from_dict({field: docs})}
    if eval_docs is not None:
        splits["validation"] = datasets.Dataset.from_dict({field: eval_docs})
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved dataset with train and validation splits of the shipped language."""
    docs = generate_documents(900, 7)
    return _save_dataset(tmp_path_factory.mktemp("ds") / "lang", docs[:800], docs[800:])


@pytest.mark.fast
def test_the_cache_is_built_once_and_reused(saved, tmp_path, monkeypatch):
    from automodel.data import token_cache
    from automodel.data.sources import token_stream

    data = HFDataConfig(path=saved, cache_dir=str(tmp_path))
    first = token_stream("hf", data)
    # the same documents, tokenized in memory, give the same stream
    docs = generate_documents(900, 7)[:800]
    expected = np.concatenate([np.frombuffer(d.encode(), np.uint8) for d in docs for d in
                               (d + "\n",)])
    assert np.array_equal(np.asarray(first.tokens), expected)
    assert len(first.doc_starts) == 800 and isinstance(first.tokens, np.memmap)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the second run must not tokenize")

    monkeypatch.setattr(token_cache, "build_entry", no_tokenizing)
    again = token_stream("hf", data)
    assert np.array_equal(np.asarray(again.tokens), expected)
    # another text field or tokenizer is another cache entry (and would be built)
    with pytest.raises(AssertionError, match="must not tokenize"):
        token_stream("hf", HFDataConfig(path=saved, cache_dir=str(tmp_path),
                                        template="Q: {text}"))


@pytest.mark.fast
def test_templates_and_data_files(tmp_path):
    import pandas as pd

    from automodel.data.sources import token_stream

    pd.DataFrame({"instruction": ["add 1 and 1", "name a colour"],
                  "response": ["2", "red"],
                  "chat": [[{"role": "user", "content": "hi"}],
                           [{"role": "user", "content": "yo"},
                            {"role": "assistant", "content": "hey"}]]}
                 ).to_parquet(tmp_path / "part-0.parquet")
    data = HFDataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"),
                        template="Q: {instruction}\nA: {response}")
    stream = token_stream("hf", data)
    assert bytes(np.asarray(stream.tokens, np.uint8)).decode() == (
        "Q: add 1 and 1\nA: 2\nQ: name a colour\nA: red\n")
    # chat messages as the text field are refused (data.format=chat renders them with the
    # tokenizer's chat template: tests/data/test_chat_data.py); in a template, one line each
    with pytest.raises(ValueError, match="holds chat messages: set data.format=chat "
                                         "data.messages_field=chat"):
        token_stream("hf", HFDataConfig(path=str(tmp_path / "*.parquet"),
                                        cache_dir=str(tmp_path / "cache"), text_field="chat"))
    chat = token_stream("hf", HFDataConfig(path=str(tmp_path / "*.parquet"),
                                           cache_dir=str(tmp_path / "cache"), template="{chat}"))
    assert bytes(np.asarray(chat.tokens, np.uint8)).decode() == (
        "user: hi\nuser: yo\nassistant: hey\n")


def _prepare(overrides, tmp_path):
    from automodel.api import load_config
    from automodel.checks.preflight import prepare_data

    prepare_data(load_config(overrides, str(tmp_path)))


@pytest.mark.fast
def test_bad_data_is_a_clear_error_before_training(saved, tmp_path):
    from automodel.api import load_config
    from automodel.config.build import ConfigError

    cache = f"data.cache_dir={tmp_path / 'cache'}"
    with pytest.raises(ConfigError, match="data.path='/no/such': no such file"):
        load_config(["data=hf", "data.path=/no/such"], str(tmp_path))
    with pytest.raises(ConfigError, match="data.path is not set"):
        load_config(["data=hf"], str(tmp_path))
    with pytest.raises(ConfigError, match=r"no field 'body' \(data.text_field\); the records "
                                          r"have \['text'\]"):
        _prepare(["data=hf", f"data.path={saved}", "data.text_field=body", cache], tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no documents"):
        _prepare(["data=hf", f"data.path={tmp_path / 'empty.jsonl'}", cache], tmp_path)
    empty = _save_dataset(tmp_path / "empty", [])
    with pytest.raises(ConfigError, match=f"cannot read the dataset saved at {empty}"):
        _prepare(["data=hf", f"data.path={empty}", cache], tmp_path)
    with pytest.raises(ConfigError, match=r"data.split='test': the dataset .* has the splits "
                                          r"\['train', 'validation'\]"):
        _prepare(["data=hf", f"data.path={saved}", "data.split=test", cache], tmp_path)
    from tests.data.test_data import _save_word_tokenizer

    _save_word_tokenizer(tmp_path / "tok", generate_documents(300, 1))
    with pytest.raises(ConfigError, match=r"token id \d+ but the model's vocabulary has 8 "):
        _prepare(["data=hf", f"data.path={saved}", cache, f"data.tokenizer_path={tmp_path}/tok",
                  "model.config.vocab_size=8"], tmp_path)
    with pytest.raises(ConfigError, match="no data is held out"):
        load_config(["data=hf", f"data.path={saved}", "trainer.eval_every=5"], str(tmp_path))
    # a corrupt cache entry: named, with the fix
    run = ["data=hf", f"data.path={saved}", f"data.cache_dir={tmp_path / 'other'}"]
    _prepare(run, tmp_path)
    (entry,) = [p for p in (tmp_path / "other" / "tokens").iterdir() if p.is_dir()]
    with open(entry / "tokens.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match=rf"token cache {entry}: tokens.bin has 10 bytes.*"
                                          rf"corrupt; delete {entry}"):
        _prepare(run, tmp_path)


@pytest.mark.fast
def test_pretokenized_token_files(tmp_path):
    from automodel.data.sources import token_rows

    tokens = np.arange(100, dtype=np.int32) % 50
    np.save(tmp_path / "t.npy", tokens)
    np.save(tmp_path / "d.npy", np.array([0, 10, 55], dtype=np.int64))
    data = TokensDataConfig(path=str(tmp_path / "t.npy"), doc_starts_path=str(tmp_path / "d.npy"),
                            cache_dir=str(tmp_path / "cache"), pack_boundaries=True)
    rows = token_rows("tokens", data, seq_len=19, model_vocab=64)
    assert len(rows) == 5
    inputs, labels, extras = rows[torch.tensor([2])].split()
    assert inputs[0].tolist() == list(range(40, 50)) + list(range(0, 9))
    assert extras["position_ids"][0, 15:].tolist() == [0, 1, 2, 3]  # document 2 starts at 55
    with pytest.raises(ValueError, match="token id 49 but the model's vocabulary has 40"):
        token_rows("tokens", data, seq_len=19, model_vocab=40)
    np.save(tmp_path / "bad.npy", np.array([0, 70, 30]))
    with pytest.raises(ValueError, match="increasing, starting at 0"):
        token_rows("tokens", TokensDataConfig(path=str(tmp_path / "t.npy"),
                                              doc_starts_path=str(tmp_path / "bad.npy"),
                                              cache_dir=str(tmp_path / "cache")), 19, 64)


EVAL = ["trainer.eval_every=2", "trainer.max_steps=4", "optim.warmup_steps=0"]


def test_eval_loss_is_the_same_in_every_layout(saved, tmp_path):
    run = ["data=hf", f"data.path={saved}", "data.eval_split=validation",
           f"data.cache_dir={tmp_path / 'cache'}"] + EVAL
    ref = train(["parallelism=none"] + run, tmp_path / "none", base=TRAINER)
    evals = [r["eval_loss"] for r in ref if "eval_loss" in r]
    assert [r["step"] for r in ref if "eval_loss" in r] == [2, 4] and evals[1] < evals[0]
    layouts = {
        "fsdp2_dp2": ["parallelism=fsdp2", FP32, "mesh.dp_size=2"],
        "tp2_pp2": ["parallelism=fsdp2", FP32, "mesh.tp_size=2", "mesh.pp_size=2",
                    "pipeline=1f1b", "pipeline.pp_microbatch_size=2"],
        "cp2": ["parallelism=fsdp2", FP32, "mesh.dp_size=1", "mesh.cp_size=2"],
    }
    for name, layout in layouts.items():
        got = train(layout + run, tmp_path / name, base=TRAINER)
        np.testing.assert_allclose([r["eval_loss"] for r in got if "eval_loss" in r], evals,
                                   rtol=1e-5, err_msg=name)
        np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref],
                                   rtol=1e-5, err_msg=name)
        np.testing.assert_allclose([r["grad_norm"] for r in got],
                                   [r["grad_norm"] for r in ref], rtol=1e-4, err_msg=name)


def test_resume_continues_the_uninterrupted_run(saved, tmp_path):
    from tests.distributed.test_checkpoint_layouts import assert_continues

    run = ["parallelism=fsdp2", FP32, "mesh.dp_size=2", "data=hf", f"data.path={saved}",
           f"data.cache_dir={tmp_path / 'cache'}", "data.pack_boundaries=true",
           "data.eval_fraction=0.1", "trainer.eval_every=3", "trainer.max_steps=6",
           "checkpoint.every_steps=3"]
    full = train(run, tmp_path / "full", base=TRAINER)
    entries = sorted((tmp_path / "cache" / "tokens").glob("*/tokens.bin"))
    built = [os.stat(p).st_mtime_ns for p in entries]
    train(run + ["trainer.stop_at_step=3"], tmp_path / "split", base=TRAINER)
    again = train(run + ["checkpoint.resume=auto"], tmp_path / "split", base=TRAINER)
    assert_continues(again, full)
    assert [r["eval_loss"] for r in again if "eval_loss" in r] == \
        [r["eval_loss"] for r in full if r["step"] == 6]
    assert [os.stat(p).st_mtime_ns for p in entries] == built  # the cache was not rebuilt
    assert full[-1]["epoch"] > 0


@pytest.mark.fast  # one process, no process group
def test_reading_ahead_changes_nothing(tmp_path):
    run = ["parallelism=none", "data=corpus", "data.num_documents=400",
           "data.pack_boundaries=true", "trainer.max_steps=3"]
    ahead = train(run + ["trainer.prefetch_steps=2"], tmp_path / "ahead", base=TRAINER)
    inline = train(run + ["trainer.prefetch_steps=0"], tmp_path / "inline", base=TRAINER)
    assert [(r["loss"], r["grad_norm"]) for r in ahead] == \
        [(r["loss"], r["grad_norm"]) for r in inline]
