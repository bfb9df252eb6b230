"""A safetensors file written one tensor at a time: the header (every name, dtype, shape and
byte range) first, from shapes known in advance, then each tensor's bytes as it is produced.
``safetensors.torch.save_file`` serializes the whole file in memory first (twice the file's
bytes on the host); an export that streams writes a file holding none of it at once.

The format: 8 bytes (little-endian) of header length, the JSON header (padded with spaces to a
multiple of 8), then the tensors' bytes, contiguous, in the header's order.
"""

from __future__ import annotations

import json
import struct

import torch

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class StreamedFile:
    """``entries``: (name, dtype, shape) of every tensor, in the order they will be written."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple]]):
        header, offset = {}, 0
        self.order = []
        for name, dtype, shape in entries:
            nbytes = dtype.itemsize * _numel(shape)
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self.order.append((name, dtype, tuple(shape)))
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor, as the header announced it."""
        expected = self.order[self.next]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != expected:
            raise ValueError(f"{self.file.name}: expected {expected} next, got {got}")
        self.file.write(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
        self.next += 1

    def close(self) -> None:
        missing = self.order[self.next:]
        self.file.close()
        if missing:
            raise ValueError(f"{self.file.name}: {len(missing)} tensors never written, first "
                             f"{missing[0][0]}")

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.close()
        else:
            self.file.close()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
