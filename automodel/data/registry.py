"""The data sources: each ``data=<name>`` is one registered ``DataSource``, the one home of its
name, schema, checks and run-time hooks.

A new source is a schema (a dataclass with an ``eval_fraction`` field), a ``DataSource`` passed
to ``register_data_source`` (in the module that defines the schema, so that every process that
unpickles the config registers it too) and an option file ``data/<name>.yaml`` whose defaults
list names the schema (``- /schema/data@_here_: <name>``), in ``conf/`` or in a directory on
Hydra's search path (``hydra.searchpath=[file:///my/conf]``). ``docs/data.md`` shows one.

Torch-free: ``config/`` imports this module (the checks run before any process starts); the
run-time hooks are import paths, loaded when called (``data/sources.py`` calls them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from automodel.config import schema as s
from automodel.config import validate_data as v
from automodel.registry import Hook, Registry, load_hook


@dataclass(frozen=True)
class DataSource:
    """One ``data=<name>``. Hooks (import paths or callables; ``data`` is the schema's
    instance, ``vocab`` the model's vocabulary size):

    - ``check(data, model) -> data``: config-time, torch-free: the options alone and against
      the ``ModelConfig``; raises ``ConfigError``, returns the (resolved) config and never
      changes its input. Every source's ``data.eval_fraction`` is checked besides.
    - ``stream(data) -> TokenStream``: the corpus as one token stream (rows are cut from it,
      ``data.pack_boundaries`` applies); or
    - ``rows(data, seq_len, vocab) -> LongTensor [n, seq_len + 1]``: the rows themselves.
    - ``held_out(data, seq_len, vocab)``: rows of its own to evaluate on, or None (then the
      last ``data.eval_fraction`` of the rows are held out).
    - ``image_text(data, seq_len, model_cfg, meta_model, text_rows)``: the samples of an
      image-text model (``text_rows()``: this source's rows as one tensor); with
      ``image_check(meta_model)``, run before launch (``ValueError``: the family cannot take
      them). None: image-text models are refused.
    - ``prepare(data, vocab)``: before any rank starts (build a cache, check the ids);
      ``ValueError`` for bad data.
    """

    name: str
    schema: type  # the dataclass its option file is built from
    check: Optional[Callable] = None
    stream: Optional[Hook] = None
    rows: Optional[Hook] = None
    held_out: Optional[Hook] = None
    image_text: Optional[Hook] = None
    image_check: Optional[Hook] = None
    prepare: Optional[Hook] = None

    def __post_init__(self):
        if (self.stream is None) == (self.rows is None):
            raise TypeError(f"data source {self.name!r}: give exactly one of stream (a token "
                            "stream rows are cut from) and rows (the rows themselves)")
        if (self.image_text is None) != (self.image_check is None):
            raise TypeError(f"data source {self.name!r}: image_text and image_check come "
                            "together (the samples, and the check before launch)")
        fields = {f.name for f in dataclasses.fields(self.schema)} if dataclasses.is_dataclass(
            self.schema) else set()
        if "eval_fraction" not in fields:
            raise TypeError(f"data source {self.name!r}: its schema {self.schema!r} needs an "
                            "eval_fraction field (float = 0.0: the rows held out for "
                            "trainer.eval_every), as every source has")

    def hook(self, which: str) -> Callable:
        """The run-time hook ``which`` (imported now)."""
        return load_hook(getattr(self, which), f"data={self.name} ({which})")


DATA_SOURCES: Registry[DataSource] = Registry("data", "data source")

_SOURCES = "automodel.data.sources."
_GENERATED_IMAGES = dict(image_text=_SOURCES + "generated_image_text",
                         image_check=_SOURCES + "check_generated_images")

SHIPPED = (
    # the shipped procedural language, byte-level tokens
    DataSource("corpus", s.CorpusDataConfig, check=v.check_corpus,
               stream=_SOURCES + "corpus_stream", **_GENERATED_IMAGES),
    # uniform random tokens from a seed
    DataSource("synthetic", s.SyntheticDataConfig, check=v.check_synthetic,
               rows=_SOURCES + "synthetic_rows", **_GENERATED_IMAGES),
    # local .txt / .jsonl files, and image-text samples through the model's processor
    DataSource("files", s.FilesDataConfig, check=v.check_files,
               stream=_SOURCES + "files_stream", image_text=_SOURCES + "files_image_text",
               image_check=_SOURCES + "check_processor_images"),
    # a local Hugging Face dataset, tokenized once into a memory-mapped cache
    DataSource("hf", s.HFDataConfig, check=v.check_hf, stream=_SOURCES + "hf_stream",
               held_out=_SOURCES + "hf_eval_rows", prepare=_SOURCES + "prepare_hf"),
    # pre-tokenized: a .npy of token ids, memory-mapped
    DataSource("tokens", s.TokensDataConfig, check=v.check_tokens,
               stream="automodel.data.token_cache.token_file_stream",
               prepare=_SOURCES + "prepare_tokens"),
)
for _source in SHIPPED:
    DATA_SOURCES.register(_source)


def register_data_source(source: DataSource) -> DataSource:
    """Make ``data=<source.name>`` available (its option file must exist too)."""
    return DATA_SOURCES.register(source)


def data_source(name: str) -> DataSource:
    """The source called ``name``; an unknown name is a ``ConfigError`` with the allowed
    names and the closest one."""
    return DATA_SOURCES.get(name)


def image_text_refusal(name: str, model_class: str) -> str:
    """Why ``data=<name>`` cannot feed the image-text model ``model_class``."""
    able = sorted(s.name for s in DATA_SOURCES if s.image_text is not None)
    return (f"data={name} with the image-text model {model_class}: image-text models train on "
            f"a source that makes image-text samples: data={', '.join(able)} "
            "(docs/image_text.md)")
