"""What a Hugging Face export writes, decided before any weight is read: every tensor name of the
model (a tied weight once), its shape, the export's dtype, and the safetensors files the names
go into (each at most ``checkpoint.export_max_shard_size``, in the model's order, whole
decoder layers to a file), and which writer (one per host) writes each file.

Every writer computes the same layout from the model's config alone, so the files can be
written in parallel without a word between them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from automodel.checkpoint.verify import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportLayout:
    names: tuple[str, ...]  # the model's tensors, in its order, a tied weight once
    shapes: dict  # name -> torch.Size
    files: tuple[tuple[str, ...], ...]  # the names of each file, in file order
    dtype: torch.dtype  # of every floating tensor written

    def file_name(self, index: int) -> str:
        if len(self.files) == 1:
            return SINGLE_FILE
        return f"model-{index + 1:05d}-of-{len(self.files):05d}.safetensors"

    def mine(self, writer: int, writers: int) -> list[int]:
        """The files writer ``writer`` of ``writers`` writes (every writers-th one)."""
        return list(range(writer, len(self.files), writers))


def unique_names(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s state, a tensor held under several names (tied embeddings)
    under its first one (the input embedding's, as ``save_pretrained`` keeps it)."""
    seen, names = set(), []
    state = model.state_dict(keep_vars=True)
    for name, value in state.items():
        if id(value) not in seen:
            seen.add(id(value))
            names.append(name)
    return names


def plan_export(model: torch.nn.Module, dtype: torch.dtype, max_bytes: int) -> ExportLayout:
    """The layout of ``model``'s export (``model``: built on the meta device) in ``dtype``, in
    files of at most ``max_bytes``, each holding whole read groups (a decoder layer's tensors
    stay in one file: the renames and splits of ``save_pretrained``'s names work within a
    layer; a group larger than ``max_bytes`` has a file of its own)."""
    state = model.state_dict(keep_vars=True)
    names = unique_names(model)
    files, current, size = [], [], 0
    for group in read_groups(names):
        nbytes = sum(state[n].numel() * (dtype.itemsize if state[n].is_floating_point()
                                         else state[n].element_size()) for n in group)
        if current and size + nbytes > max_bytes:
            files.append(tuple(current))
            current, size = [], 0
        current += group
        size += nbytes
    if current:
        files.append(tuple(current))
    if not files:
        raise CheckpointError(f"{type(model).__name__} has no weights to export")
    return ExportLayout(tuple(names), {n: state[n].shape for n in names}, tuple(files), dtype)


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def read_groups(names) -> list[list[str]]:
    """``names`` (in order) in groups read together: each decoder layer's tensors, every other
    tensor alone: what a writer holds beside its file at once."""
    groups: list[list[str]] = []
    last = None
    for name in names:
        m = _LAYER.match(name)
        key = m.group(1) if m else name
        if groups and key == last:
            groups[-1].append(name)
        else:
            groups.append([name])
        last = key
    return groups
