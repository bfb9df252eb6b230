"""A procedurally generated toy language: deterministic from a seed, learnable by a tiny model.

Documents are short stories made of sentences from a small grammar: agents with fixed
adjectives act on objects in places, counts spell out numbers in order, and questions get a
fixed answer pattern. A tiny model learns spelling, word order and the counting sequences, so
the byte-level loss falls well below the 5.5 nats of uniform bytes.
"""

from __future__ import annotations

import random

_NAMES = ["ada", "bo", "cyrus", "dina", "emil", "fay", "gus", "hana", "ivo", "juno"]
_TRAITS = {n: t for n, t in zip(_NAMES, ["brave", "calm", "quick", "shy", "loud", "kind",
                                         "old", "tiny", "wise", "bold"])}
_VERBS = [("sees", "saw"), ("finds", "found"), ("takes", "took"), ("paints", "painted"),
          ("moves", "moved"), ("hides", "hid")]
_OBJECTS = ["a red box", "the blue cup", "a small key", "the green lamp", "a round stone",
            "the old map", "a white bird", "the yellow kite"]
_PLACES = ["in the garden", "near the river", "under the bridge", "at the market",
           "on the hill", "inside the house"]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    name = rng.choice(_NAMES)
    if kind < 0.45:
        present, _ = rng.choice(_VERBS)
        return f"the {_TRAITS[name]} {name} {present} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
    if kind < 0.7:
        _, past = rng.choice(_VERBS)
        obj = rng.choice(_OBJECTS)
        return f"yesterday {name} {past} {obj}, and today {name} has {obj}."
    if kind < 0.85:
        start = rng.randrange(0, 6)
        return f"{name} counts: " + " ".join(_NUMBERS[start:start + 5]) + "."
    return f"who is {_TRAITS[name]}? {name} is {_TRAITS[name]}."


def generate_documents(num_documents: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))
            for _ in range(num_documents)]
