"""Documents of a local Hugging Face dataset (``data=hf``), never from the network.

``data.path`` is a ``save_to_disk`` directory (a ``Dataset`` or a ``DatasetDict`` of splits),
or data files read by ``datasets.load_dataset`` streaming (no copy into the datasets cache):
one file, a directory of them, or a glob, of parquet, JSON lines, arrow or CSV. A document
is the record's ``data.text_field``, or ``data.template`` filled with the record's fields
(``"{instruction}\\n{response}"``); chat and prompt/completion records are rendered by
``data/sft.py``.
"""

from __future__ import annotations

import glob
import hashlib
import os
import string
from pathlib import Path

_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow",
             ".csv": "csv"}


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in
                                 ("dataset_info.json", "state.json", "dataset_dict.json"))


def data_files(path: str) -> list[str]:
    """The data files ``path`` names (a file, a directory or a glob), sorted."""
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.suffix in _BUILDERS)
    elif any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if Path(f).suffix in _BUILDERS)
    else:
        files = [path] if p.is_file() else []
    return files


def check_source(path: str, split: str) -> None:
    """Raise ``ValueError`` unless ``path`` is a saved dataset or names data files of one
    kind (before anything is read)."""
    p = Path(path)
    if not p.exists() and not any(c in path for c in "*?["):
        raise ValueError(f"data.path={path!r}: no such file or directory")
    if _is_saved_dataset(p):
        return
    files = data_files(path)
    if not files:
        raise ValueError(f"data.path={path!r}: neither a dataset saved with save_to_disk nor "
                         f"data files ({', '.join(sorted(_BUILDERS))})")
    kinds = {_BUILDERS[Path(f).suffix] for f in files}
    if len(kinds) > 1:
        raise ValueError(f"data.path={path!r} holds files of several kinds ({sorted(kinds)}); "
                         "point it at one kind")


def fingerprint(path: str, split: str) -> str:
    """What identifies the data: the saved dataset's own fingerprint, or each data file's
    path, size and modification time."""
    h = hashlib.sha256(f"{split}\0".encode())
    p = Path(path)
    if _is_saved_dataset(p):
        for f in sorted(p.rglob("*")):
            if f.is_file():
                st = f.stat()
                h.update(f"{f.relative_to(p)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    else:
        for f in data_files(path):
            st = os.stat(f)
            h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def template_fields(text_field: str, template: str | None) -> list[str]:
    if template is None:
        return [text_field]
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    return list(dict.fromkeys(name.split(".")[0].split("[")[0] for name in names))


def _missing(wanted: list[str], have: list[str], where: str, keys: dict) -> None:
    lost = [f for f in wanted if f not in have]
    if lost:
        raise ValueError(f"{where}: no field {lost[0]!r} ({keys.get(lost[0], 'data.template')})"
                         f"; the records have {sorted(have)}")


def iter_documents(path: str, split: str, wanted: list[str], keys: dict, render):
    """(the split's documents, their number or None), read in column batches: a saved
    dataset or parquet files through arrow, other files through datasets' streaming.
    ``wanted``: the fields read (``keys``: the option naming each); ``render(record, where)``
    makes a document of a record."""
    import datasets

    where = f"data.path={path!r} (split {split!r})"
    p = Path(path)
    if _is_saved_dataset(p):
        ds = _load_saved(p)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"data.split={split!r}: the dataset at {path} has the splits "
                                 f"{sorted(ds)}")
            ds = ds[split]
        _missing(wanted, ds.column_names, where, keys)
        batches = (b for b in ds.select_columns(wanted).iter(batch_size=1024))
        return _texts(batches, render, where), len(ds)
    files = data_files(path)
    if Path(files[0]).suffix == ".parquet":
        import pyarrow.parquet as pq

        def parquet_batches():
            for f in files:
                pf = pq.ParquetFile(f)
                _missing(wanted, pf.schema_arrow.names, f"{where}, {f}", keys)
                for batch in pf.iter_batches(batch_size=1024, columns=wanted):
                    yield batch.to_pydict()

        total = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        if not total:
            raise ValueError(f"data.path={path!r}: no documents in {len(files)} file(s)")
        return _texts(parquet_batches(), render, where), total
    builder = _BUILDERS[Path(files[0]).suffix]
    try:
        ds = datasets.load_dataset(builder, data_files={split: files}, split=split,
                                   streaming=True)
    except StopIteration:  # (how datasets reports files without a record)
        raise ValueError(f"data.path={path!r}: no documents in {len(files)} file(s)") from None
    except Exception as err:
        raise ValueError(f"cannot read the data files of data.path={path!r}: "
                         f"{type(err).__name__}: {err}") from None
    records = ({k: [v] for k, v in r.items()} for r in ds)
    return _texts(records, render, where), None


def _load_saved(p: Path):
    import datasets

    try:
        return datasets.load_from_disk(str(p))
    except Exception as err:  # datasets raises several kinds for broken or empty folders
        raise ValueError(f"cannot read the dataset saved at {p}: {type(err).__name__}: "
                         f"{err or 'no data'}") from None


def first_record(path: str, split: str) -> dict | None:
    """The first record of the split (None: it has none), reading nothing more."""
    import datasets

    p = Path(path)
    if _is_saved_dataset(p):
        ds = _load_saved(p)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split] if split in ds else None
        return ds[0] if ds is not None and len(ds) else None
    files = data_files(path)
    if Path(files[0]).suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(files[0]).iter_batches(batch_size=1):
            return {k: v[0] for k, v in batch.to_pydict().items()}
        return None
    try:
        ds = datasets.load_dataset(_BUILDERS[Path(files[0]).suffix],
                                   data_files={split: files}, split=split, streaming=True)
    except StopIteration:  # (how datasets reports files without a record)
        return None
    return next(iter(ds), None)


def _texts(batches, render, where: str):
    """Documents from column batches ({field: [values]})."""
    count = 0
    for batch in batches:
        columns = list(batch)
        for row in zip(*batch.values()):
            yield render(dict(zip(columns, row)), f"{where}, record {count}")
            count += 1


def _is_chat(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "content" in m for m in value)


def _render(value) -> str:
    """A field in a template: chat messages as one ``role: content`` line each."""
    if _is_chat(value):
        return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in value)
    return str(value)


def document_text(record: dict, text_field: str, template: str | None, where: str) -> str:
    """The text of one record; a missing field is an error naming it and the record's
    fields."""
    if template is None:
        if text_field not in record:
            raise ValueError(f"{where}: no field {text_field!r} (data.text_field); the records "
                             f"have {sorted(record)}")
        if _is_chat(record[text_field]):
            raise ValueError(f"{where}: data.text_field={text_field!r} holds chat messages: set "
                             f"data.format=chat data.messages_field={text_field} to render them "
                             "with the tokenizer's chat template")
        return str(record[text_field])
    try:
        return template.format_map({k: _render(v) for k, v in record.items()})
    except KeyError as err:
        raise ValueError(f"{where}: data.template names the field {err}, which the records do "
                         f"not have (they have {sorted(record)})") from None
