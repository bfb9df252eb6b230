"""Is a checkpoint whole, and does it fit this model? Errors name the path and the keys.

``check_files`` needs no process group (it runs at config time, in the launching process):
the directory is complete (``trainer.json``, DCP's ``.metadata``), and every shard file the
metadata refers to exists and is long enough (a truncated copy is caught here, not halfway
through a load). ``check_keys`` runs on every rank before loading: each key this rank will
read exists with the same global shape, and the checkpoint holds no model weights that no
rank of this job has (a checkpoint of a deeper or different model).
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from automodel.errors import CheckpointError


def _shorten(items: list[str], limit: int = 8) -> str:
    items = sorted(items)
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def read_metadata(path: str) -> Metadata:
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: no such directory")
    if not os.path.isfile(os.path.join(path, "trainer.json")):
        raise CheckpointError(f"checkpoint {path} is incomplete (no trainer.json): a save that "
                              "never finished, or not a checkpoint directory")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"checkpoint {path} has no .metadata: not a "
                              "torch.distributed.checkpoint directory")
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as err:  # a truncated or foreign pickle
        raise CheckpointError(f"checkpoint {path}: cannot read .metadata ({type(err).__name__}: "
                              f"{err})") from None


def check_files(path: str) -> Metadata:
    """The checkpoint at ``path`` is complete and no shard file is missing or truncated."""
    meta = read_metadata(path)
    needed: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"{name} is missing")
        elif os.path.getsize(file) < end:
            problems.append(f"{name} is truncated ({os.path.getsize(file)} of at least {end} "
                            "bytes)")
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
    return meta


def _global_shape(value):
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


def check_keys(path: str, meta: Metadata, wanted: dict, all_model_keys: set[str]) -> None:
    """``wanted``: the flattened keys this rank loads (``model.<fqn>``, ``optim.<...>``) with
    their live values; ``all_model_keys``: the ``model.`` keys of every rank of the job."""
    saved = meta.state_dict_metadata
    missing, mismatched = [], []
    for key, value in wanted.items():
        if key not in saved:
            missing.append(key)
            continue
        shape = _global_shape(value)
        info = saved[key]
        if shape is not None and isinstance(info, TensorStorageMetadata) \
                and tuple(info.size) != shape:
            mismatched.append(f"{key} (checkpoint {list(info.size)}, model {list(shape)})")
    unexpected = [k for k in saved if k.startswith("model.") and k not in all_model_keys]
    if not (missing or mismatched or unexpected):
        return
    lines = [f"checkpoint {path} does not fit this model and optimizer (a different model, "
             "shapes or optimizer?):"]
    if mismatched:
        lines.append(f"  shapes differ: {_shorten(mismatched)}")
    if missing:
        lines.append(f"  missing from the checkpoint: {_shorten(missing)}")
    if unexpected:
        lines.append(f"  in the checkpoint but not in the model: {_shorten(unexpected)}")
    raise CheckpointError("\n".join(lines))
