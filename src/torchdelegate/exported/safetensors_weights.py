"""Weights in safetensors files, read by memory map.

A checkpoint's tensors are views of its files' pages: nothing is read until a stage touches a
tensor, and a stage that has made its own form of one (quantized, packed, written out) lets the
pages go again (:func:`release_pages`), so a model larger than memory passes through a process
one tensor at a time. The mapping is private: a page written through a view would stay in this
process, never reach the file.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchdelegate.errors import CheckpointError
from torchdelegate.exported.mapped_pages import register_mapping, release_pages

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes are: its file and the byte range in it."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of a checkpoint's safetensors files, by name, each a view of its file's pages.

    ``files``: a ``.safetensors`` file, several (a sharded checkpoint), or a directory holding
    ``model.safetensors`` or ``model.safetensors.index.json`` and its shards. A name read twice
    gives the same tensor, so two programs bound to one checkpoint share every weight.
    """

    def __init__(self, files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> None:
        self.files = checkpoint_files(files)
        self.locations: dict[str, TensorLocation] = {}
        for file in self.files:
            for name, location in read_header(file).items():
                if name in self.locations:
                    raise CheckpointError(f"{file}: tensor {name!r} is also in {self.locations[name].file}")
                self.locations[name] = location
        self._maps: dict[Path, mmap.mmap] = {}
        self._tensors: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = self._tensors[name] = self._view(self.locations[name])
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.locations))

    def __len__(self) -> int:
        return len(self.locations)

    def nbytes(self) -> int:
        """The bytes of every tensor, read from the headers."""
        return sum(location.end - location.start for location in self.locations.values())

    def release(self, name: str) -> None:
        """Let the OS drop the pages of ``name`` from this process; they are read again when touched."""
        location = self.locations[name]
        mapping = self._maps.get(location.file)
        if mapping is not None:
            release_pages(mapping, location.start, location.end - location.start)

    def _view(self, location: TensorLocation) -> torch.Tensor:
        mapping = self._maps.get(location.file)
        if mapping is None:
            with location.file.open("rb") as handle:
                mapping = self._maps[location.file] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            register_mapping(mapping)
        count = (location.end - location.start) // max(1, torch.empty((), dtype=location.dtype).element_size())
        if count == 0:
            return torch.empty(location.shape, dtype=location.dtype)
        flat = torch.frombuffer(mapping, dtype=location.dtype, count=count, offset=location.start)
        return flat.view(location.shape)


def checkpoint_files(files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The safetensors files ``files`` names: itself, its items, or a directory's single file or shards."""
    if isinstance(files, (str, os.PathLike)):
        path = Path(files)
        if path.is_dir():
            return _directory_files(path)
        paths = [path]
    else:
        paths = [Path(f) for f in files]
    if not paths:
        raise CheckpointError("no safetensors file given: give a .safetensors file, several, or their directory")
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"{path}: no such safetensors file")
    return paths


def _directory_files(directory: Path) -> list[Path]:
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            shards = sorted({str(shard) for shard in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{directory / INDEX} has no weight_map of tensor names to shard files ({e})") from e
        missing = [shard for shard in shards if not (directory / shard).is_file()]
        if missing:
            raise CheckpointError(f"{directory / INDEX} names shards that are not in {directory}: {', '.join(missing)}")
        return [directory / shard for shard in shards]
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    raise CheckpointError(
        f"{directory}: no {SINGLE} or {INDEX}; save the weights as safetensors (save_pretrained does by default)"
    )


def read_header(file: Path) -> dict[str, TensorLocation]:
    """The tensors ``file``'s header lists, with their byte ranges checked against the file's size."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file} is not a safetensors file: it has no header")
        if prefix.startswith(b"PK\x03\x04"):
            raise CheckpointError(
                f"{file} is not a safetensors file: it is a zip archive, as torch.save writes; save the weights with "
                "safetensors.torch.save_file (or save_pretrained)"
            )
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{file} is not a safetensors file: its header length {length} is not in the file")
        try:
            header = json.loads(handle.read(length))
        except ValueError as e:
            raise CheckpointError(f"{file} is not a safetensors file: its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is not a safetensors file: its header is not a JSON object")
    base = 8 + length
    return {name: _location(file, name, entry, base, size) for name, entry in header.items() if name != "__metadata__"}


def _location(file: Path, name: str, entry: Any, base: int, size: int) -> TensorLocation:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: tensor {name!r} has no readable dtype, shape and data_offsets ({e})") from e
    expected = torch.empty((), dtype=dtype).element_size()
    for n in shape:
        expected *= n
    if end - begin != expected or begin < 0 or base + end > size:
        raise CheckpointError(f"{file}: tensor {name!r} ({entry['dtype']} {list(shape)}) does not fit its byte range")
    return TensorLocation(file, dtype, shape, base + begin, base + end)
