"""Supervised fine-tuning data (``data.format=chat|prompt_completion``, ``data.train_on``): chat
records rendered with the tokenizer's own chat template, labels kept only on the assistant
turns or the completion, found from the template itself (with and without ``{% generation %}``
markers); masked tokens contribute nothing to the loss or its gradients, packed and sharded."""

import json

import numpy as np
import pytest
import torch

from automodel.config.schema import HFDataConfig

SPECIAL = ["[UNK]", "[EOS]", "<s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
# Two templates rendering the same text; the first marks the assistant's turns for HF's own
# assistant mask (``return_assistant_tokens_mask``), the second has no markers.
TURN = "{{ '<|' + m['role'] + '|> ' }}"
WITH_MARKERS = ("{{ '<s> ' }}{% for m in messages %}" + TURN + "{% if m['role'] == 'assistant' %}"
                "{% generation %}{{ m['content'] + ' <|end|> ' }}{% endgeneration %}"
                "{% else %}{{ m['content'] + ' <|end|> ' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")
WITHOUT_MARKERS = ("{{ '<s> ' }}{% for m in messages %}" + TURN + "{{ m['content'] + ' <|end|> ' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")
TEMPLATES = {"with_markers": WITH_MARKERS, "without_markers": WITHOUT_MARKERS}


def _conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Chats of 1-2 exchanges, some with a system turn; words from small per-role sets, so the
    trained words differ from the prompt's."""
    rng = np.random.default_rng(seed)
    ask, say = [f"q{i}" for i in range(12)], [f"a{i}" for i in range(12)]
    chats = []
    for _ in range(n):
        chat = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 3))):
            chat.append({"role": "user", "content": " ".join(rng.choice(ask, rng.integers(2, 6)))})
            chat.append({"role": "assistant",
                         "content": " ".join(rng.choice(say, rng.integers(1, 5)))})
        chats.append(chat)
    return chats


def save_chat_tokenizer(path, template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"q{i}" for i in range(12)] + [f"a{i}" for i in range(12)] + ["be", "brief"]
    vocab = {w: i for i, w in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]",
                                   bos_token="<s>", additional_special_tokens=SPECIAL[3:])
    fast.chat_template = template
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    with open(root / "chat.jsonl", "w") as f:
        for chat in _conversations(300):
            f.write(json.dumps({"messages": chat}) + "\n")
    for name, template in TEMPLATES.items():
        save_chat_tokenizer(root / name, template)
    return root


@pytest.mark.fast
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_exactly_the_assistant_turns_are_labelled(chat_files, tmp_path, template):
    from transformers import AutoTokenizer

    from automodel.data.sources import token_stream

    tok_dir = str(chat_files / template)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    data = HFDataConfig(path=str(chat_files / "chat.jsonl"), cache_dir=str(tmp_path),
                        format="chat", train_on="completion", tokenizer_path=tok_dir)
    stream = token_stream("hf", data)
    tokens, train = np.asarray(stream.tokens), np.asarray(stream.train).astype(bool)
    bounds = list(stream.doc_starts) + [len(tokens)]
    chats = _conversations(300)
    for i, chat in enumerate(chats):
        ids, mask = tokens[bounds[i]:bounds[i + 1]], train[bounds[i]:bounds[i + 1]]
        # the chat template's own rendering, then the separator
        rendered = tok.apply_chat_template(chat, return_dict=True)["input_ids"]
        assert ids.tolist() == list(rendered) + [tok.eos_token_id]
        # trained: each assistant reply and its end-of-turn, and the separator after the last
        expected = " ".join(m["content"] + " <|end|>" for m in chat if m["role"] == "assistant")
        assert tok.decode(ids[mask]) == expected + " [EOS]"
        if template == "with_markers":  # the same tokens as HF's mask from the markers
            hf = tok.apply_chat_template(chat, return_dict=True,
                                         return_assistant_tokens_mask=True)["assistant_masks"]
            assert mask[:-1].tolist() == [bool(m) for m in hf]
    # train_on=all: the same tokens, all of them labels (no mask), in another cache entry
    every = token_stream("hf", HFDataConfig(**{**data.__dict__, "train_on": "all"}))
    assert every.train is None and np.array_equal(np.asarray(every.tokens), tokens)
    assert len(list((tmp_path / "tokens").glob("chat.jsonl-*[!k]"))) == 2


@pytest.mark.fast
def test_prompt_completion_records_and_the_cache_key(chat_files, tmp_path):
    from automodel.data.sources import token_stream

    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps({"q": f"Q{i}? ", "a": f"A{i}."}) + "\n" for i in range(5)))
    data = HFDataConfig(path=str(path), cache_dir=str(tmp_path / "c"), format="prompt_completion",
                        prompt_field="q", completion_field="a", train_on="completion")
    stream = token_stream("hf", data)  # byte-level tokens
    text = bytes(np.asarray(stream.tokens, np.uint8)).decode()
    trained = bytes(np.asarray(stream.tokens, np.uint8)[np.asarray(stream.train, bool)]).decode()
    assert text == "".join(f"Q{i}? A{i}.\n" for i in range(5))
    assert trained == "".join(f"A{i}.\n" for i in range(5))
    # rows carry the mask: without boundaries, (inputs, labels) as a pipeline takes them
    from automodel.data.batches import BatchPlan
    from automodel.data.token_rows import TokenRows

    rows = TokenRows(stream, seq_len=7)
    [(inputs, labels)] = BatchPlan(rows, 2, 0, shuffle=False).micro_batches(0, 0, 1, 2)
    assert bytes(inputs[0].tolist()).decode() == "Q0? A0."
    assert [bytes([t]).decode() if t >= 0 else "-" for t in labels[0].tolist()] == \
        list("---A0.\n")  # labels predict the next token: trained from "A" on
    # another chat template (in the tokenizer's files) is another cache entry
    chat = dict(path=str(chat_files / "chat.jsonl"), cache_dir=str(tmp_path / "c"),
                format="chat", train_on="completion")
    a = token_stream("hf", HFDataConfig(**chat, tokenizer_path=str(chat_files / "with_markers")))
    b = token_stream("hf", HFDataConfig(**chat,
                                        tokenizer_path=str(chat_files / "without_markers")))
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert len(list((tmp_path / "c" / "tokens").glob("chat.jsonl-train-*[!k]"))) == 2


def _overrides(chat_files, tmp_path):
    # (no data.format: the records' messages make it chat, as users leave it)
    return ["data=hf", f"data.path={chat_files / 'chat.jsonl'}", "data.train_on=completion",
            f"data.tokenizer_path={chat_files / 'without_markers'}",
            "data.pack_boundaries=true", f"data.cache_dir={tmp_path / 'cache'}",
            "model.config.vocab_size=64"]


def _hand_loss_and_grads(overrides, output_dir):
    """Step 1 computed here in plain torch on the job's first global batch and initial model:
    the mean cross-entropy over the trained tokens only (picked from the token stream's train
    mask, not from the labels), with its gradients; and the loss over every token, for scale."""
    from automodel.api import load_config
    from automodel.data.batches import BatchPlan
    from automodel.data.sources import training_data
    from automodel.data.token_rows import restart_positions
    from automodel.loss import summed_cross_entropy
    from automodel.models.builder import build_model
    from automodel.recipes.step import known_packing

    cfg = load_config(overrides, str(output_dir))
    t = cfg.trainer
    rows, _ = training_data(cfg.data_source, cfg.data, t.seq_len, cfg.model)
    batch = BatchPlan(rows, t.global_batch_size, t.seed).global_batch(0)
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    keep = batch.train[:, 1:] & ~batch.doc_start[:, 1:]  # trained, within its document
    model = build_model(cfg.model, t.seed)
    with known_packing(packed=True):
        logits = model(input_ids=inputs, position_ids=restart_positions(batch.doc_start[:, :-1]),
                       use_cache=False).logits.float()
    hand = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    everything = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    params = list(model.parameters())
    hand_grads = torch.autograd.grad(hand, params, retain_graph=True)
    every_norm = _norm(torch.autograd.grad(everything, params, retain_graph=True))
    # the framework's loss on the same logits: labels -100 outside the trained tokens
    _, labels, _ = batch.split()
    ours = summed_cross_entropy(logits, labels) / (labels != -100).sum()
    our_grads = torch.autograd.grad(ours, params)
    return hand, every_norm, int(keep.sum()), hand_grads, our_grads


def _norm(grads) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                 for g in grads])).item()


def test_masked_tokens_contribute_nothing_packed_and_sharded(chat_files, tmp_path):
    from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
    from tests.helpers import FP32, TRAINER, train

    overrides = _overrides(chat_files, tmp_path) + ["data.eval_fraction=0.1",
                                                    "trainer.eval_every=5"]
    single = train(["parallelism=none"] + overrides, tmp_path / "single", base=TRAINER)
    hand, every_norm, count, hand_grads, our_grads = _hand_loss_and_grads(
        TRAINER + ["parallelism=none"] + overrides, tmp_path / "plain")
    norm = _norm(hand_grads)
    print(f"step 1: job loss {single[0]['loss']:.7f} grad_norm {single[0]['grad_norm']:.7f}; "
          f"by hand over {count} trained tokens: loss "
          f"{hand.item():.7f} grad_norm {norm:.7f}; grad_norm over every token "
          f"{every_norm:.7f}")
    for mine, theirs in zip(our_grads, hand_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(single[0]["loss"], hand.item(), rtol=1e-5)
    np.testing.assert_allclose(single[0]["grad_norm"], norm, rtol=1e-4)
    assert abs(every_norm - norm) > 0.1 * norm  # the mask matters: far beyond the tolerance
    # FSDP2 over 2 ranks with the fused loss: the same masked run
    sharded = train(["parallelism=fsdp2", FP32, "trainer.loss=fused"] + overrides,
                    tmp_path / "fsdp2", base=TRAINER)
    print("losses, 1 process:", [r["loss"] for r in single], "fsdp2 dp2:",
          [r["loss"] for r in sharded])
    assert_matches(sharded, single)
    np.testing.assert_allclose([r["eval_loss"] for r in sharded if "eval_loss" in r],
                               [r["eval_loss"] for r in single if "eval_loss" in r], rtol=1e-5)
    # the defaults users run (bf16 parameters) with 2 micro-batches per rank: the masked token
    # count must be the global batch's, whatever micro-batch the trained tokens fall in
    default = train(["parallelism=fsdp2", "trainer.local_batch_size=2"] + overrides,
                    tmp_path / "default", base=TRAINER)
    assert_close_to_fp32(default, single, loss_rtol=2e-2)


@pytest.mark.fast
def test_the_format_is_read_from_the_records_unless_given(chat_files, tmp_path, caplog):
    import logging

    from automodel.api import load_config

    tok = f"data.tokenizer_path={chat_files / 'without_markers'}"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i} ",
                                         "completion": f"it is {2 * i}"}) + "\n"
                             for i in range(4)))
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "it is 4"}) + "\n")
    chat = ["data=hf", f"data.path={chat_files / 'chat.jsonl'}", tok]
    with caplog.at_level(logging.INFO, logger="automodel.data.sft"):
        cfg = load_config(chat + ["data.train_on=completion"], str(tmp_path))
    assert (cfg.data.format, cfg.data.train_on) == ("chat", "completion")
    assert "data.format=auto: chat (the records hold a list of messages in 'messages')" \
        in caplog.text
    cfg = load_config(["data=hf", f"data.path={pairs}", "data.train_on=completion"],
                      str(tmp_path))
    assert cfg.data.format == "prompt_completion"
    assert load_config(["data=hf", f"data.path={texts}"], str(tmp_path)).data.format == "text"
    # a saved dataset and parquet files are read the same way
    import datasets

    records = [json.loads(line) for line in pairs.read_text().splitlines()]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "pairs.parquet"))
    for path in (tmp_path / "saved", tmp_path / "pairs.parquet"):
        assert load_config(["data=hf", f"data.path={path}"],
                           str(tmp_path)).data.format == "prompt_completion"
    # an explicit format wins over what the records show
    cfg = load_config(["data=hf", f"data.path={pairs}", "data.format=text",
                       "data.text_field=prompt"], str(tmp_path))
    assert cfg.data.format == "text"
    messages_as_text = load_config(chat + ["data.format=text"], str(tmp_path))
    assert messages_as_text.data.format == "text"


@pytest.mark.fast
def test_bad_sft_options_are_clear_errors_before_launch(chat_files, tmp_path):
    from automodel.api import load_config
    from automodel.config.build import ConfigError
    from automodel.data.sources import token_stream

    run = ["data=hf", f"data.path={chat_files / 'chat.jsonl'}"]
    for extra, message in [
            (["data.format=json"],
             "data.format='json': one of auto, text, chat, prompt_completion"),
            (["data.train_on=prompt"], "data.train_on='prompt': one of all, completion"),
            (["data.format=text", "data.train_on=completion"],
             "data.train_on=completion with data.format=text"),
            (["data.format=chat"], "data.format=chat needs a tokenizer with a chat template"),
            # detected from the records: the same rule
            ([], "data.format=chat needs a tokenizer with a chat template")]:
        with pytest.raises(ConfigError, match=message):
            load_config(run + extra, str(tmp_path))
    plain = tmp_path / "plain_tok"
    save_chat_tokenizer(plain, WITHOUT_MARKERS)
    config = plain / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items()
                                  if k != "chat_template"}))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no chat template"):
        token_stream("hf", HFDataConfig(path=str(chat_files / "chat.jsonl"), format="chat",
                                        tokenizer_path=str(plain), cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"no field 'turns' \(data.messages_field\); the "
                                         r"records have \['messages'\]"):
        token_stream("hf", HFDataConfig(path=str(chat_files / "chat.jsonl"), format="chat",
                                        messages_field="turns", cache_dir=str(tmp_path),
                                        tokenizer_path=str(chat_files / "with_markers")))
    # a template that renders the last turn unlike earlier ones: its turns cannot be found
    shifty = tmp_path / "shifty_tok"
    save_chat_tokenizer(shifty, "{% for m in messages %}" + TURN + "{% if loop.last %}"
                        "{{ 'be ' }}{% endif %}{{ m['content'] + ' <|end|> ' }}{% endfor %}")
    with pytest.raises(ValueError, match=r"record 0: the chat template does not render this "
                                         r"conversation .* use data.train_on=all"):
        token_stream("hf", HFDataConfig(path=str(chat_files / "chat.jsonl"), format="chat",
                                        train_on="completion", cache_dir=str(tmp_path),
                                        tokenizer_path=str(shifty)))
