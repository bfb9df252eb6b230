"""What a LoRA checkpoint says of its frozen base, instead of holding it.

A ``peft=lora`` checkpoint holds the adapters and their optimizer state only; the base is
referenced: its directory and a fingerprint (a pretrained model), or its config, dtype and
seed (a model built from config: the same seed gives the same weights). Resume and export
read the base from there, and resume refuses a base whose fingerprint differs.

The fingerprint is a SHA-256 over each weight file's name and size, a safetensors file's
header (every tensor's name, dtype, shape and offsets) and the first and last 64 KiB of its
data: a few reads per file, for a 405B checkpoint as for a tiny one. A changed weight keeps
its header, so a file rewritten in place with other values of the same shapes is caught only
where those bytes change; a different model, size, dtype or a file edited in its first or
last 64 KiB is caught.
"""

from __future__ import annotations

import hashlib
import os
import struct

from automodel.config import schema as s

_EDGE = 64 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".json")


def _file_digest(h, path: str) -> None:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}:{size}".encode())
    with open(path, "rb") as f:
        if path.endswith(".safetensors") and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(header_len, size - 8)))
        else:
            f.seek(0)
        h.update(f.read(_EDGE))
        f.seek(max(0, size - _EDGE))
        h.update(f.read(_EDGE))


def base_reference(model: s.ModelConfig, seed: int) -> dict:
    """The base model of a run, as its checkpoints record it."""
    if model.pretrained_path is None:
        return {"config": dict(model.config), "dtype": model.dtype, "seed": seed}
    h = hashlib.sha256()
    path = model.pretrained_path
    for name in sorted(os.listdir(path)):
        if name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(path, name)):
            _file_digest(h, os.path.join(path, name))
    return {"pretrained_path": os.path.abspath(path), "sha256": h.hexdigest()}


def same_base(saved: dict, now: dict) -> bool:
    if "sha256" in saved or "sha256" in now:
        return saved.get("sha256") == now.get("sha256")
    return saved == now
