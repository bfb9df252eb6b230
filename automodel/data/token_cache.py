"""Tokenize once: a corpus's token ids on disk, memory-mapped by every run and every rank.

A cache entry is a folder ``<cache_dir>/<source>-<key>`` (``data/token_stream.py`` reads it):
``tokens.bin`` (ids as uint8, uint16 or uint32, the smallest type that holds the
vocabulary), ``doc_starts.npy`` (each document's first offset) and ``meta.json``. The key
hashes what decides the tokens: the data (a saved dataset's files, or each data file's path,
size and modification time), the text field or template, the tokenizer's files, and the
format version; change any and a new entry is built.

One process builds an entry while the others wait on a file lock beside it (the launcher
before it starts ranks; under torchrun or SLURM the first rank to get there). It writes into a
temporary folder renamed into place when complete, so an interrupted build leaves nothing a
later run would read. A fast tokenizer encodes each batch of documents on all cores (byte-level
tokens are a single-threaded copy).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from automodel import user_cache
from automodel.data import hf_dataset, sft
from automodel.data.token_stream import (
    DOC_STARTS,
    FORMAT,
    META,
    TOKENS,
    TRAIN,
    TokenStream,
    open_stream,
    token_dtype,
    write_meta,
)
from automodel.errors import FileWriteError

log = logging.getLogger(__name__)
BATCH = 1024  # documents tokenized together
BYTE_SEPARATOR = ord("\n")


def cache_root(cache_dir: str | None) -> Path:
    """``data.cache_dir``, else ``$AUTOMODEL_CACHE``, else ``~/.cache/automodel``; entries
    live in its ``tokens/`` folder."""
    return (Path(cache_dir) if cache_dir else user_cache.cache_root()) / "tokens"


# Weights in a checkpoint directory that is also the tokenizer's: not hashed (not read).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def tokenizer_identity(tokenizer_path: str | None) -> str:
    if tokenizer_path is None:
        return "bytes"
    h = hashlib.sha256()
    for f in sorted(Path(tokenizer_path).iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


class Encoder:
    """Documents to token ids, each ending in the separator (the tokenizer's EOS, else SEP,
    else none; a newline byte for byte-level tokens). ``masked``: also which tokens are
    trained on, from each ``sft.Document``'s character spans (the separator is trained when
    the document's last token is)."""

    def __init__(self, tokenizer_path: str | None, masked: bool = False):
        self.tokenizer = None
        self.masked = masked
        if tokenizer_path is None:
            self.separator, self.max_id = BYTE_SEPARATOR, 255
            return
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        tok = self.tokenizer
        self.separator = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        self.max_id = len(tok) - 1
        if masked and not tok.is_fast:
            raise ValueError(f"data.train_on=completion needs a fast tokenizer (character "
                             f"offsets); the one at {tokenizer_path} is not")

    def __call__(self, docs: list) -> tuple:
        """(the documents' tokens end to end, each document's length[, the train mask]), as
        arrays."""
        texts = [getattr(d, "text", d) for d in docs]
        if self.tokenizer is None and not self.masked:
            encoded = [t.encode("utf-8") for t in texts]
            flat = np.frombuffer(b"\n".join(encoded) + b"\n", dtype=np.uint8) if texts else \
                np.zeros(0, dtype=np.uint8)
            return flat, np.fromiter((len(e) + 1 for e in encoded), np.int64, len(encoded))
        if self.tokenizer is None:
            ids = [list(t.encode("utf-8")) for t in texts]
            offsets = [_byte_offsets(t) for t in texts] if self.masked else None
        else:
            enc = self.tokenizer(texts, add_special_tokens=False,
                                 return_offsets_mapping=self.masked)
            ids, offsets = enc["input_ids"], enc.get("offset_mapping")
        tail = [self.separator] if self.separator is not None else []
        arrays = [np.asarray(list(d) + tail, dtype=np.int64) for d in ids]
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        lengths = np.fromiter((len(d) for d in arrays), np.int64, len(arrays))
        if not self.masked:
            return flat, lengths
        masks = [_train_mask(getattr(d, "spans", None), o, len(tail))
                 for d, o in zip(docs, offsets)]
        return flat, lengths, (np.concatenate(masks) if masks else np.zeros(0, np.uint8))


def _byte_offsets(text: str) -> list[tuple[int, int]]:
    """Each UTF-8 byte's character (start, end)."""
    return [(i, i + 1) for i, ch in enumerate(text) for _ in ch.encode("utf-8")]


def _train_mask(spans, offsets, tail: int) -> np.ndarray:
    """1 for each token whose first character lies in a trained span (all without spans),
    then the separator's, as the last token's."""
    starts = np.fromiter((o[0] for o in offsets), np.int64, len(offsets))
    if spans is None:
        keep = np.ones(len(starts), dtype=bool)
    else:
        keep = np.zeros(len(starts), dtype=bool)
        for lo, hi in spans:
            keep |= (starts >= lo) & (starts < hi)
    last = bool(keep[-1]) if len(keep) else False
    return np.concatenate([keep, np.full(tail, last)]).astype(np.uint8)


def build_entry(folder: Path, texts: Iterable[str], total: int | None, encode: Encoder,
                describe: str) -> None:
    """Tokenize ``texts`` into the cache entry ``folder`` (written beside it, then renamed)."""
    from tqdm import tqdm

    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = token_dtype(encode.max_id)
    offset, num_docs, max_token, batch = 0, 0, -1, []
    bar = tqdm(total=total, unit="doc", desc=f"tokenizing {describe}", file=sys.stderr,
               mininterval=2.0, disable=None)
    try:
        # tokens and document starts go straight to disk: memory stays one batch
        with open(tmp / TOKENS, "wb") as out, open(tmp / "doc_starts.raw", "wb") as starts, \
                open(tmp / TRAIN, "wb") as train:
            def flush():
                nonlocal offset, num_docs, max_token
                flat, lengths, *mask = encode(batch)
                if mask:
                    mask[0].tofile(train)
                (offset + np.concatenate([[0], np.cumsum(lengths)[:-1]])).astype(
                    np.int64).tofile(starts)
                offset += int(lengths.sum())
                num_docs += len(lengths)
                if flat.size:
                    max_token = max(max_token, int(flat.max()))
                flat.astype(dtype, copy=False).tofile(out)
                bar.update(len(batch))
                batch.clear()

            for text in texts:
                batch.append(text)
                if len(batch) == BATCH:
                    flush()
            if batch:
                flush()
        bar.close()
        if not num_docs:
            raise ValueError(f"{describe}: no documents (an empty dataset or split)")
        _save_doc_starts(tmp, num_docs)
        if not encode.masked:
            (tmp / TRAIN).unlink()
        write_meta(tmp, dtype=np.dtype(dtype).name, num_tokens=offset, num_docs=num_docs,
                   max_token=max_token, source=describe, train_mask=encode.masked)
        os.replace(tmp, folder)
    except OSError as err:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileWriteError(f"cannot write the token cache {folder}: {type(err).__name__}: "
                             f"{err}; free space there or set data.cache_dir elsewhere "
                             "(the unfinished entry was removed)") from err
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_doc_starts(tmp: Path, num_docs: int) -> None:
    """doc_starts.raw (int64, end to end) as the .npy array the entry keeps."""
    raw = np.memmap(tmp / "doc_starts.raw", dtype=np.int64, mode="r", shape=(num_docs,))
    saved = np.lib.format.open_memmap(tmp / DOC_STARTS, mode="w+", dtype=np.int64,
                                      shape=(num_docs,))
    for i in range(0, num_docs, 1 << 22):
        saved[i:i + (1 << 22)] = raw[i:i + (1 << 22)]
    saved.flush()
    del raw, saved
    (tmp / "doc_starts.raw").unlink()


def ensure_entry(folder: Path, build: Callable[[Path], None]) -> Path:
    """The cache entry ``folder``, built by ``build(folder)`` if no process has yet (it must
    leave ``meta.json`` there last); other processes wait for it."""
    from filelock import FileLock, Timeout

    if not (folder / META).exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(folder) + ".lock")
        try:
            lock.acquire(timeout=1)
        except Timeout:
            log.info("waiting for another process to build the token cache %s", folder)
            lock.acquire()
        try:
            if not (folder / META).exists():
                build(folder)
                log.info("token cache written: %s", folder)
        finally:
            lock.release()
    return folder


def hf_stream(data, split: str) -> TokenStream:
    """The tokens of split ``split`` of the ``data=hf`` dataset (a ``HFDataConfig``)."""
    hf_dataset.check_source(data.path, split)
    data = sft.concrete_format(data, split)  # (data.format=auto: from the first record)
    # the tokenizer's files hold its chat template; render_key: the record format, its fields,
    # data.train_on
    key = hashlib.sha256("\0".join([
        hf_dataset.fingerprint(data.path, split), sft.render_key(data),
        tokenizer_identity(data.tokenizer_path), str(FORMAT)]).encode()).hexdigest()[:20]
    name = Path(data.path.rstrip("/")).name.replace("*", "_") or "data"
    folder = cache_root(data.cache_dir) / f"{name}-{split}-{key}"

    def build(target: Path) -> None:
        encode = Encoder(data.tokenizer_path, masked=data.train_on == "completion")
        docs, total = hf_dataset.iter_documents(
            data.path, split, sft.record_fields(data), sft.field_options(data),
            sft.Renderer(data, encode.tokenizer))
        build_entry(target, docs, total, encode, f"data.path={data.path!r} (split {split!r})")

    return open_stream(ensure_entry(folder, build))


def token_file_stream(data) -> TokenStream:
    """``data=tokens``: a pre-tokenized corpus, a ``.npy`` array of token ids (and optionally
    a ``.npy`` of document start offsets), or a token-cache folder. The arrays are checked
    once (their largest id, the offsets' order) and the result is cached."""
    path = Path(data.path)
    if path.is_dir():
        return open_stream(path)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0"
                         f"{data.doc_starts_path}\0{FORMAT}".encode()).hexdigest()[:20]
    folder = cache_root(data.cache_dir) / f"{path.stem}-scan-{key}"

    def scan(target: Path) -> None:
        tokens = load_token_array(path)
        max_token = -1
        for i in range(0, len(tokens), 1 << 24):
            max_token = max(max_token, int(tokens[i:i + (1 << 24)].max()))
        starts = load_doc_starts(data.doc_starts_path, len(tokens))
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        write_meta(tmp, max_token=max_token, num_docs=int(len(starts)),
                   num_tokens=int(len(tokens)), scan_of=str(path))
        os.replace(tmp, target)

    import json

    meta = json.loads((ensure_entry(folder, scan) / META).read_text())
    return TokenStream(load_token_array(path), load_doc_starts(data.doc_starts_path,
                                                               meta["num_tokens"]),
                       int(meta["max_token"]))


def load_token_array(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise ValueError(f"data.path={str(path)!r}: not a .npy array ({err})") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or not len(tokens):
        raise ValueError(f"data.path={str(path)!r}: a non-empty 1-D integer array is needed, "
                         f"found {tokens.dtype} of shape {tokens.shape}")
    return tokens


def load_doc_starts(path: str | None, num_tokens: int) -> np.ndarray:
    if path is None:
        return np.zeros(1, dtype=np.int64)  # one document
    try:
        starts = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise ValueError(f"data.doc_starts_path={path!r}: not a .npy array ({err})") from None
    ok = (starts.ndim == 1 and starts.dtype.kind in "iu" and len(starts) and starts[0] == 0
          and (len(starts) == 1 or bool((np.diff(starts) > 0).all()))
          and int(starts[-1]) < num_tokens)
    if not ok:
        raise ValueError(f"data.doc_starts_path={path!r}: document start offsets must be a 1-D "
                         f"integer array, increasing, starting at 0 and below the number of "
                         f"tokens ({num_tokens})")
    return starts
