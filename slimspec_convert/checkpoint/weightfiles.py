"""Weight-file formats: safetensors headers, zero-copy views, streamed writes (I/O layer).

Knows file *formats* only; checkpoint layouts, key names and file names live in
:mod:`slimspec_convert.checkpoint` and :mod:`slimspec_convert.checkpoint.dialects`.
"""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slimspec_convert.atomic import atomic_path
from slimspec_convert.lowrank.blocks import count_nonfinite


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and the field."""


# safetensors dtype names (https://github.com/huggingface/safetensors, format spec)
_ST_DTYPES = {
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
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


_MAX_HEADER_BYTES = 100_000_000


_COPY_CHUNK_BYTES = 64 * 1024 * 1024


class _SafetensorsFile:
    """One safetensors file: parsed header, lazily memory-mapped data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mmap: mmap.mmap | None = None

    def mapped(self) -> mmap.mmap:
        # ACCESS_COPY: private pages, so torch.frombuffer gets a writable buffer and the file is never
        # written; pages are read from the page cache on first touch.
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._mmap


@dataclass(eq=False)
class TensorRef:
    """One tensor of a weight file, not read yet.

    Attributes:
        file: the file holding it.
        key: its name in that file.
        dtype: torch dtype from the file header (never from config.json, eagle3-formats.md P14).
        shape: shape from the header.
        offset: absolute byte offset in a safetensors file (-1 for a .bin tensor).
        value: the tensor itself for pytorch_model.bin (memory-mapped by torch.load).
    """

    file: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = -1
    value: Tensor | None = None
    _source: _SafetensorsFile | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the data in bytes."""
        return self.numel * _itemsize(self.dtype)

    @property
    def where(self) -> str:
        """``file: 'key'`` for messages."""
        return f"{self.file}: '{self.key}'"

    def load(self) -> Tensor:
        """A fresh tensor owning its memory (safetensors: read with one positioned read)."""
        if self.value is not None:
            return self.value.clone()
        t = torch.empty(self.shape, dtype=self.dtype)
        if self.numel:
            buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            with open(self.file, "rb") as f:
                f.seek(self.offset)
                got = f.readinto(buf)
            if got != self.nbytes:
                raise CheckpointError(
                    f"{self.where}: read {got} of {self.nbytes} bytes; the file is truncated"
                )
        return t

    def view(self) -> Tensor:
        """A zero-copy, read-only-by-convention view (memory-mapped for safetensors).

        Reading rows of the view touches only those pages, so a large head can be processed in
        blocks without a second copy in memory. Do not write to it.
        """
        if self.value is not None:
            return self.value
        if not self.numel:
            return torch.empty(self.shape, dtype=self.dtype)
        flat = torch.frombuffer(self._source.mapped(), dtype=self.dtype, count=self.numel, offset=self.offset)
        return flat.view(self.shape)

    def raw_chunks(self):
        """Yield the tensor's bytes in chunks (for byte-identical copies)."""
        if self.value is not None:
            yield _tensor_bytes(self.value)
            return
        with open(self.file, "rb") as f:
            f.seek(self.offset)
            left = self.nbytes
            while left:
                chunk = f.read(min(left, _COPY_CHUNK_BYTES))
                if not chunk:
                    raise CheckpointError(f"{self.where}: the file ended {left} bytes early; it is truncated")
                left -= len(chunk)
                yield chunk


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _tensor_bytes(t: Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def read_safetensors_header(path: Path) -> dict[str, TensorRef]:
    """Parse and validate a safetensors header without reading tensor data.

    The checks are the reference reader's (safetensors ``SafeTensors::deserialize``): the tensors'
    byte ranges, sorted, must tile the data section exactly, with no overlap, gap or trailing byte.

    Args:
        path: a ``.safetensors`` file.

    Returns:
        {key: TensorRef} in file order.

    Raises:
        CheckpointError: file too short, header length beyond the file, invalid JSON, a key given
            twice, metadata that is not strings, unknown dtype, a negative dimension, a tensor
            whose byte span does not match its dtype and shape, byte ranges that overlap or leave
            a gap, data past the end of the file (truncated download) or bytes after the last
            tensor; the message names the file and the tensor.
    """
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: header length {n} does not fit the file size {size}; "
                "truncated or not a safetensors file"
            )
        raw = f.read(n)
    header = _parse_header(path, raw)
    data_start, data_len = 8 + n, size - 8 - n
    source = _SafetensorsFile(path)
    refs: dict[str, TensorRef] = {}
    spans: list[tuple[int, int, str]] = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, start, stop = _parse_entry(path, key, info)
        if stop > data_len:
            raise CheckpointError(
                f"{path}: tensor '{key}' needs bytes up to {stop} of the data section but the file "
                f"holds only {data_len}; the file is truncated (re-download it)"
            )
        spans.append((start, stop, key))
        refs[key] = TensorRef(path, key, dtype, shape, data_start + start, _source=source)
    _check_tiling(path, spans, data_len)
    return refs


def _parse_header(path: Path, raw: bytes) -> dict[str, Any]:
    """The header JSON object; a key given twice or non-string metadata is refused (the reference does)."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for k, v in pairs:
            if k in seen:
                raise CheckpointError(f"{path}: tensor '{k}' appears twice in the safetensors header")
            seen[k] = v
        return seen

    try:
        header = json.loads(raw, object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: '__metadata__' must map strings to strings, got {meta!r}")
    return header


def _parse_entry(path: Path, key: str, info: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, start, stop) of one header entry, its byte span checked against dtype and shape."""
    try:
        dtype = _ST_DTYPES[info["dtype"]]
        shape = tuple(int(x) for x in info["shape"])
        start, stop = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: tensor '{key}' has a malformed header entry {info!r} ({e})") from e
    if any(x < 0 for x in shape):
        raise CheckpointError(f"{path}: tensor '{key}' has a negative dimension in shape {list(shape)}")
    need = math.prod(shape) * _itemsize(dtype)
    if stop - start != need or start < 0:
        raise CheckpointError(
            f"{path}: tensor '{key}' spans bytes [{start}, {stop}) but dtype {info['dtype']} and shape "
            f"{list(shape)} need {need} bytes; corrupt header"
        )
    return dtype, shape, start, stop


def _check_tiling(path: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """Sorted byte ranges must cover [0, data_len) exactly once: one tensor's bytes are never another's."""
    end, prev = 0, None
    for start, stop, key in sorted(spans):
        if start < end:
            raise CheckpointError(
                f"{path}: tensor '{key}' spans bytes [{start}, {stop}) of the data section, overlapping "
                f"'{prev}' (ends at {end}); corrupt header (the reference safetensors reader refuses it)"
            )
        if start > end:
            raise CheckpointError(
                f"{path}: tensor '{key}' starts at byte {start} of the data section but the tensors before "
                f"it end at {end}; corrupt header (a gap of {start - end} unaccounted bytes)"
            )
        end, prev = stop, key
    if end != data_len:
        raise CheckpointError(
            f"{path}: the data section holds {data_len} bytes but its tensors end at byte {end}; "
            "corrupt header or trailing bytes (the reference safetensors reader refuses it)"
        )


def write_safetensors(
    path: Path, tensors: list[tuple[str, TensorRef | Tensor]], metadata: dict[str, str]
) -> int:
    """Stream tensors into a safetensors file (temp file, then rename), one tensor in memory at a time.

    A :class:`TensorRef` is copied byte for byte from its source file; a tensor is written as is.

    Args:
        path: destination file.
        tensors: (name, tensor or reference) in the order to write.
        metadata: string metadata stored in the header.

    Returns:
        Bytes written.

    Raises:
        ValueError: a tensor (not a file reference, which its reader checked) holds NaN/inf, e.g.
            factors that overflowed when cast to float16; nothing is written.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        if isinstance(t, Tensor) and t.is_floating_point() and t.dim() and (bad := count_nonfinite(t)):
            raise ValueError(f"{path}: '{name}' has {bad} NaN/inf entries ({t.dtype}); refusing to write it")
        nbytes = t.nbytes if isinstance(t, TensorRef) else t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # data section 8-byte aligned, as the reference writer does
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for _name, t in tensors:
            for chunk in t.raw_chunks() if isinstance(t, TensorRef) else (_tensor_bytes(t),):
                f.write(chunk)
    return 8 + len(hb) + offset
