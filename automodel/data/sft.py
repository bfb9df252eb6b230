"""Supervised fine-tuning records of ``data=hf`` (``data.format``): chat conversations rendered
with the tokenizer's own chat template, and prompt/completion pairs.

A record becomes a ``Document``: its text and, with ``data.train_on=completion``, the character
ranges trained on (the assistant turns, or the completion). The assistant turns are found from
the template itself, rendering the conversation prefix by prefix: turn ``i`` is what
``messages[:i+1]`` adds to ``messages[:i]`` with the generation prompt (the assistant header is
prompt, the turn's text and its end-of-turn marks are trained). That needs no
``{% generation %}`` markers, and works for any template whose rendering of a conversation
starts with its rendering of each prefix; a template that is not is refused, naming the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

RENDER_VERSION = "sft-1"  # in the token cache key: change it when rendering changes


@dataclass
class Document:
    text: str
    spans: Optional[list[tuple[int, int]]] = None  # trained [start, end) characters; None: all


FORMATS = ("auto", "text", "chat", "prompt_completion")


def detect_format(record: dict | None, data) -> tuple[str, str]:
    """(the format of ``data.format=auto``'s records, why), from one record: a list of
    messages in ``data.messages_field`` is chat; ``data.prompt_field`` and
    ``data.completion_field`` make prompt_completion; anything else is text."""
    from automodel.data.hf_dataset import _is_chat

    if record is None:
        return "text", "the split has no record"
    if _is_chat(record.get(data.messages_field)):
        return "chat", f"the records hold a list of messages in {data.messages_field!r}"
    if data.prompt_field in record and data.completion_field in record:
        return "prompt_completion", (f"the records have the fields {data.prompt_field!r} and "
                                     f"{data.completion_field!r}")
    return "text", f"the records have neither (their fields: {', '.join(sorted(record))})"


def concrete_format(data, split: str, record: dict | None = None):
    """``data`` (a ``HFDataConfig``) with ``format=auto`` replaced by what the split's first
    record shows (logged, with the reason); an explicit format as it is. Raises
    ``ValueError`` where the records cannot be read, or what they show cannot take
    ``data.train_on`` (``check_train_on``)."""
    import dataclasses
    import logging

    from automodel.data.hf_dataset import first_record

    if data.format != "auto":
        return data
    try:
        record = record if record is not None else first_record(data.path, split)
    except ValueError:  # (what hf_dataset says of unreadable data)
        raise
    except Exception as err:  # (datasets and arrow raise several kinds for unreadable data)
        raise ValueError(f"data.format=auto: cannot read the first record of data.path="
                         f"{data.path!r} (split {split!r}) to tell its format: "
                         f"{type(err).__name__}: {err}; set data.format") from None
    found, why = detect_format(record, data)
    logging.getLogger(__name__).info("data.format=auto: %s (%s); set data.format to choose "
                                     "another", found, why)
    data = dataclasses.replace(data, format=found)
    check_train_on(data, f" (data.format=auto found {found}: {why})")
    return data


def check_train_on(data, how: str = "") -> None:
    """``data.train_on=completion`` needs records with a completion: chat or
    prompt_completion."""
    if data.train_on == "completion" and data.format == "text":
        raise ValueError(f"data.train_on=completion with data.format=text{how}: plain text has "
                         "no completion; set data.format=chat (assistant turns) or "
                         "data.format=prompt_completion, or data.train_on=all")


def record_fields(data) -> list[str]:
    """The record fields ``data`` (a ``HFDataConfig``) reads."""
    if data.format == "chat":
        return [data.messages_field]
    if data.format == "prompt_completion":
        return [data.prompt_field, data.completion_field]
    from automodel.data.hf_dataset import template_fields

    return template_fields(data.text_field, data.template)


def field_options(data) -> dict:
    """Each field read -> the option naming it (for the error of a record without it)."""
    if data.format == "chat":
        return {data.messages_field: "data.messages_field"}
    if data.format == "prompt_completion":
        return {data.prompt_field: "data.prompt_field",
                data.completion_field: "data.completion_field"}
    return {data.text_field: "data.text_field"} if data.template is None else {}


def render_key(data) -> str:
    """What, besides the data and the tokenizer's files (its chat template among them), decides
    the tokens and their labels: part of the token cache key."""
    return "\0".join([RENDER_VERSION, data.format, data.train_on, data.text_field,
                      str(data.template), data.messages_field, data.prompt_field,
                      data.completion_field])


def _field(record: dict, name: str, key: str, where: str):
    if name not in record:
        raise ValueError(f"{where}: no field {name!r} ({key}); the records have "
                         f"{sorted(record)}")
    return record[name]


class Renderer:
    """``record -> Document`` for ``data`` (a ``HFDataConfig``); ``tokenizer``: the loaded
    tokenizer (None: byte-level tokens)."""

    def __init__(self, data, tokenizer=None):
        self.data = data
        self.tokenizer = tokenizer
        self.masked = data.train_on == "completion"
        if data.format == "chat" and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"data.format=chat: the tokenizer at data.tokenizer_path="
                             f"{data.tokenizer_path!r} has no chat template; use a tokenizer "
                             "that has one (its tokenizer_config.json or chat_template.jinja)")

    def __call__(self, record: dict, where: str) -> Document | str:
        data = self.data
        if data.format == "chat":
            messages = _field(record, data.messages_field, "data.messages_field", where)
            return self.chat(list(messages), where)
        if data.format == "prompt_completion":
            prompt = str(_field(record, data.prompt_field, "data.prompt_field", where))
            completion = str(_field(record, data.completion_field, "data.completion_field",
                                    where))
            text = prompt + completion
            return Document(text, [(len(prompt), len(text))] if self.masked else None)
        from automodel.data.hf_dataset import document_text

        return document_text(record, data.text_field, data.template, where)

    def _render(self, messages, generation_prompt: bool = False) -> str:
        if not messages and not generation_prompt:
            return ""
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def chat(self, messages: list, where: str) -> Document:
        text = self._render(messages)
        if not self.masked:
            return Document(text)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            upto = self._render(messages[:i + 1])
            header = self._render(messages[:i], generation_prompt=True)
            if not upto.startswith(header):  # a template without a generation prompt
                header = self._render(messages[:i])
            if not (text.startswith(upto) and upto.startswith(header)):
                raise ValueError(f"{where}: the chat template does not render this "
                                 "conversation as the rendering of its first messages followed "
                                 "by the rest, so its assistant turns cannot be found for "
                                 "data.train_on=completion; use data.train_on=all, or a "
                                 "template that renders earlier turns the same way")
            spans.append((len(header), len(upto)))
        return Document(text, spans)
