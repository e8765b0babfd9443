"""Streaming safetensors I/O: a checkpoint of any size in bounded memory.

The format is an 8-byte little-endian header length, a JSON header
(`name -> {dtype, shape, data_offsets}` relative to the byte buffer, plus an
optional `__metadata__`), then the byte buffer. Because every output shape and
dtype is known before a byte is written, a shard's header is written first and
each tensor is then streamed into place block by block (`BLOCK_BYTES` of rows
at a time), read with plain file reads (no mmap, so the page cache is not
counted as the process' memory).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
BLOCK_BYTES = 64 << 20  # rows read, converted and written at a time
MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live in a source file."""

    name: str
    file: Path
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict]:
    """The tensors of one .safetensors file (name -> TensorInfo) and its metadata."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = struct.unpack("<Q", raw)[0]
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file or truncated (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (the header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    base, out, covered = 8 + n, {}, 0
    for name, h in header.items():
        try:
            dtype, shape, (begin, end) = h["dtype"], tuple(int(d) for d in h["shape"]), map(int, h["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: damaged safetensors header (entry {name!r} is not "
                             f"{{dtype, shape, data_offsets}})") from None
        if dtype not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != want:
            raise ValueError(f"{path}: tensor {name!r} holds {end - begin} bytes, its shape {list(shape)} needs {want}")
        if base + end > size:
            raise ValueError(f"{path}: truncated (tensor {name!r} ends at byte {base + end}, file has {size})")
        out[name] = TensorInfo(name, path, dtype, shape, base + begin, end - begin)
        covered = max(covered, end)
    if base + covered != size:  # safetensors itself refuses a buffer with bytes no tensor covers
        raise ValueError(f"{path}: damaged ({size - base - covered} bytes after the last tensor)")
    return out, meta


def iter_blocks(info: TensorInfo, dtype: torch.dtype, block_bytes: int = BLOCK_BYTES) -> Iterator[torch.Tensor]:
    """Yield the tensor as consecutive row blocks (dim 0), converted to `dtype`."""
    rows = info.shape[0] if info.shape else 1
    row_bytes = info.nbytes // rows if rows else 0
    step = max(1, block_bytes // max(row_bytes, 1))
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.offset)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            block = torch.empty(((r1 - r0),) + info.shape[1:] if info.shape else (), dtype=info.torch_dtype)
            buf = block.view(-1).view(torch.uint8).numpy() if block.numel() else None
            if buf is not None:
                got = f.readinto(buf)
                if got != buf.nbytes:
                    raise ValueError(f"{info.file}: truncated while reading {info.name!r}")
            yield block.to(dtype)


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ShardWriter:
    """Writes one .safetensors file whose tensors are known in advance.

        with ShardWriter(path, planned) as w:
            for t in planned: for block in ...: w.write(t.name, block)

    Tensors must arrive in the planned order, each as row blocks adding up to it.
    """

    def __init__(self, path: str | Path, tensors: list[PlannedTensor], metadata: dict | None = None):
        self.path, self.tensors = Path(path), tensors
        header, pos = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
        for t in tensors:
            header[t.name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # align the byte buffer to 8 bytes, as safetensors does
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.i, self.left = 0, tensors[0].nbytes if tensors else 0

    def write(self, name: str, block: torch.Tensor) -> None:
        t = self.tensors[self.i] if self.i < len(self.tensors) else None
        if t is None or t.name != name or block.dtype != t.dtype:
            raise RuntimeError(f"{self.path}: expected {t.name if t else 'nothing'}, got {name} ({block.dtype})")
        data = block.contiguous().view(-1).view(torch.uint8).numpy() if block.numel() else b""
        n = len(data)
        if n > self.left:
            raise RuntimeError(f"{self.path}: {name} overflows its planned {t.nbytes} bytes")
        self.f.write(data)
        self.left -= n
        while self.left == 0 and self.i < len(self.tensors):
            self.i += 1
            self.left = self.tensors[self.i].nbytes if self.i < len(self.tensors) else -1

    def close(self) -> None:
        self.f.close()
        if self.i < len(self.tensors):
            raise RuntimeError(f"{self.path}: incomplete, stopped at {self.tensors[self.i].name}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self.f.close()


def plan_shards(tensors: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Greedy split in order; a tensor larger than `max_bytes` gets a shard of its own."""
    shards, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        shards.append(cur)
    return shards


def parse_size(s: str | int) -> int:
    """'5GB' / '500MB' / '2GiB' / bytes -> bytes."""
    if isinstance(s, int):
        return s
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = s.strip().upper()
    num = text.rstrip("KMGIB")
    unit = text[len(num):]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(f"bad size {s!r}: use e.g. '5GB', '500MB' or a number of bytes") from None
    if value < 1:
        raise ValueError(f"size must be positive, got {s!r}")
    return int(value)
