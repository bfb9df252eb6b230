"""Where an export reads its tensors, a few at a time: the checkpoint (torch.distributed.checkpoint
reassembles any layout's shards into whole tensors, reading only the names asked for), and,
for a checkpoint of adapters, the frozen base it references (its safetensors files, read by
name, or rebuilt from its config and seed).

The base's fingerprint is checked first: adapters only fit the base they were trained over,
and an export over another one is refused, naming both.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from automodel.checkpoint.verify import CheckpointError, check_files

PREFIX = "model."


class CheckpointTensors:
    """The model tensors of the checkpoint at ``path``, read by name."""

    def __init__(self, path: str):
        self.path = path
        meta = check_files(path)
        self.saved = {k[len(PREFIX):]: info for k, info in meta.state_dict_metadata.items()
                      if k.startswith(PREFIX) and isinstance(info, TensorStorageMetadata)}
        if not self.saved:
            raise CheckpointError(f"checkpoint {path} holds no model weights")

    def dtype(self) -> torch.dtype:
        """The dtype its floating weights were saved in."""
        floats = [i.properties.dtype for i in self.saved.values()
                  if i.properties.dtype.is_floating_point]
        return floats[0] if floats else torch.float32

    def read(self, names) -> dict[str, torch.Tensor]:
        """Whole tensors of ``names`` (all saved), nothing else read."""
        state = {n: torch.empty(self.saved[n].size, dtype=self.saved[n].properties.dtype)
                 for n in names}
        if state:
            with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"model": state}, checkpoint_id=self.path, no_dist=True)
        return state


class BaseTensors:
    """The frozen base a checkpoint of adapters references (``peft.base_ref``), read by the
    model's names: from its safetensors files where they hold them under those names (a few
    tensors at a time), else the whole base loaded once (a family stored under other names,
    or a base built from config and seed)."""

    def __init__(self, record: dict, config, model: torch.nn.Module, base_dir: str | None):
        from automodel.models.multimodal import auto_class

        self.buffers = {n: b for n, b in model.named_buffers() if not b.is_meta}
        self.aliases = aliases(model)
        base = record["base"]
        self.files, self.whole = None, None
        if "pretrained_path" in base:
            path = check_base(base, base_dir)
            from automodel.distributed.materialize import names_match
            from automodel.models.weight_files import safetensors_files

            files = safetensors_files(path)
            if files is not None and names_match(model, files):
                self.files = files
            else:  # (stored under other names: transformers renames them as it loads)
                self.whole = auto_class(config).from_pretrained(path).state_dict()
        else:
            from automodel.config import schema as s
            from automodel.models.builder import build_model

            self.whole = build_model(s.ModelConfig(config=base["config"], dtype=base["dtype"]),
                                     base["seed"]).state_dict()

    def read(self, names) -> dict[str, torch.Tensor]:
        out = {}
        handles: dict = {}
        try:
            for name in names:
                out[name] = self._one(name, handles)
        finally:
            handles.clear()  # (closes the files: their mapped pages are released)
        return out

    def _one(self, name: str, handles: dict) -> torch.Tensor:
        if self.whole is not None:
            found = next((n for n in self.aliases.get(name, [name]) if n in self.whole), None)
            if found is not None:
                return self.whole[found]
        elif self.files is not None:
            found = next((n for n in self.aliases.get(name, [name]) if n in self.files), None)
            if found is not None:
                from safetensors import safe_open

                file = self.files[found]
                if file not in handles:
                    handles[file] = safe_open(file, framework="pt")
                return handles[file].get_tensor(found)
        if name in self.buffers:  # (a buffer the base's files do not store: as built)
            return self.buffers[name]
        raise CheckpointError(f"the base model has no tensor {name!r}")


def aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every name of each state tensor, by each of its names (tied weights have several)."""
    by_id: dict[int, list[str]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(value), []).append(name)
    return {n: names for names in by_id.values() for n in names}


def check_base(base: dict, base_dir: str | None) -> str:
    """The base directory to read (``base_dir``, else the recorded one), after checking that
    its fingerprint is the one the adapters were trained over."""
    import os

    from automodel.config import schema as s
    from automodel.peft.base_ref import base_reference, same_base

    path = base_dir or base["pretrained_path"]
    if not os.path.isdir(path):
        raise CheckpointError(f"the adapters' base model {path} is not there (moved? point "
                              "the export at it: --base DIR)")
    now = base_reference(s.ModelConfig(pretrained_path=path), 0)
    if not same_base(base, now):
        raise CheckpointError(
            f"the adapters were trained over the base {base['pretrained_path']} (fingerprint "
            f"{base.get('sha256', '?')[:12]}), but {path} has fingerprint "
            f"{now['sha256'][:12]}: another model, size or dtype; export over the base they "
            "were trained on (--base DIR)")
    return path
