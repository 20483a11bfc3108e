"""Tensors in safetensors files, read by element range: what ``shard(..., source=...)`` needs to
fill a rank's shards from a model's files without loading the model.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and byte range, then the tensors' bytes, row-major. Elements start..stop of a
flattened tensor are therefore one contiguous run of bytes: ``read`` reads exactly those into a
new tensor, with no mapping of the file (whose pages would count as the process's memory) and
nothing else loaded.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

# The safetensors names of the dtypes a model's weights come in.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8}
_HEADER_LIMIT = 100 * 2 ** 20  # a header longer than this is a damaged file, not a model


@dataclass(frozen=True)
class _Entry:
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the tensor's first element in the file


class TensorFiles:
    """The tensors of some safetensors files by key; raises ``ValueError`` naming the file for
    one that is not a readable safetensors file or holds a key twice."""

    def __init__(self, paths: Iterable[str | os.PathLike]) -> None:
        self._entries: dict[str, _Entry] = {}
        for path in paths:
            for key, entry in _header(Path(path)).items():
                if key in self._entries:
                    raise ValueError(f"{path}: tensor {key!r} is also in "
                                     f"{self._entries[key].path}")
                self._entries[key] = entry

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key].shape

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements start..stop of the flattened tensor ``key``, in the file's dtype."""
        entry = self._entries[key]
        if not 0 <= start <= stop <= math.prod(entry.shape):
            raise IndexError(f"{key!r} has {math.prod(entry.shape)} elements; asked for "
                             f"{start}..{stop}")
        out = torch.empty(stop - start, dtype=entry.dtype)
        if stop == start:
            return out
        size = out.element_size()
        into = memoryview(out.view(torch.uint8).numpy())
        with open(entry.path, "rb", buffering=0) as f:
            f.seek(entry.offset + start * size)
            done = 0
            while done < len(into):
                got = f.readinto(into[done:])
                if not got:
                    raise ValueError(f"{entry.path}: ends inside tensor {key!r}")
                done += got
        return out


def _header(path: Path) -> dict[str, _Entry]:
    """The tensors a safetensors file holds, checked against the file's size."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if length is None or length > min(file_size - 8, _HEADER_LIMIT):
                raise ValueError("no safetensors header")
            header = json.loads(f.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err})") from None
    data_start = 8 + length
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {key!r} has a header entry of an unknown form "
                             f"or dtype ({info!r}); allowed dtypes: {', '.join(_DTYPES)}"
                             ) from None
        numel = math.prod(shape)
        if end - begin != numel * dtype.itemsize or data_start + end > file_size:
            raise ValueError(f"{path}: tensor {key!r} does not fit its byte range")
        out[key] = _Entry(str(path), dtype, shape, data_start + begin)
    return out
