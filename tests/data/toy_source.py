"""A data source registered from outside automodel, as a user would add one: this module (the
schema, the source and its token stream) and tests/conf/data/toy.yaml (its option file, found
through ``hydra.searchpath``). Importing this module registers ``data=toy``; a rank that
unpickles a ``ToyDataConfig`` imports it, so the ranks know the source too."""

from dataclasses import dataclass

import numpy as np

from automodel.config.build import ConfigError
from automodel.data.registry import DataSource, register_data_source
from automodel.data.token_stream import TokenStream


@dataclass
class ToyDataConfig:
    """Counting documents: ``start, start + step, ...`` (mod ``modulus``), one per start."""

    num_documents: int = 200
    length: int = 40  # tokens per document
    step: int = 3
    modulus: int = 64  # token ids stay below this
    pack_boundaries: bool = False
    eval_fraction: float = 0.0


def check_toy(data: ToyDataConfig, model) -> ToyDataConfig:
    vocab = model.config.get("vocab_size")
    if vocab is not None and data.modulus > vocab:
        raise ConfigError(f"data.modulus={data.modulus} exceeds model.config.vocab_size={vocab}")
    return data


def toy_stream(data: ToyDataConfig) -> TokenStream:
    starts = np.arange(data.num_documents, dtype=np.int64)[:, None]
    tokens = (starts + data.step * np.arange(data.length, dtype=np.int64)) % data.modulus
    return TokenStream.from_flat(tokens.reshape(-1), np.full(data.num_documents, data.length))


TOY = register_data_source(DataSource("toy", ToyDataConfig, check=check_toy, stream=toy_stream))
