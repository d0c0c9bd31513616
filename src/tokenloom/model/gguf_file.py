"""Reading a GGUF file's header: metadata key/values and tensor descriptors, and the raw bytes of
one tensor.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value, one per token and
merge of a vocabulary's arrays, before the first tensor can be touched.
The header is a plain little-endian stream, so we parse it in one pass over an `mmap` with
`struct`, decode numeric arrays with one `np.frombuffer` each, and leave the tensor data mapped
until a tensor is asked for. That keeps `load_model_config` / `load_tokenizer` cheap and
lets the caller process build its tokenizer without paying for the weights. The result is checked
against `gguf.GGUFReader` in tests/model/test_gguf_loader.py.

Layout (GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 kv count; then the key/values
(u64-length string key, u32 value type, value); then per tensor: name, u32 n_dims, u64 dims in
ggml's `ne` order (fastest-varying first, i.e. reversed from torch), u32 ggml type, u64 offset
into the data section; the data section starts at the next multiple of `general.alignment`.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenloom.model.errors import ModelLoadError, ModelNotFoundError
from tokenloom.ops.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType): scalar struct formats.
_STRING, _ARRAY = 8, 9
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
               11: "<q", 12: "<d"}
_NUMPY_DTYPE = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch (row-major) order: the reverse of ggml's ne
    ggml_type: int
    offset: int  # absolute offset of the first byte in the file
    nbytes: int
    part: int = 0  # the file of a split GGUF holding it (0: the first, or the only one)

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"ggml type {self.ggml_type}"

    @property
    def ne(self) -> list[int]:
        """The dims as llama.cpp and gguf tools print them."""
        return list(reversed(self.shape))


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    _mmap: mmap.mmap | None = field(default=None, repr=False)
    # A split GGUF's later parts (`-00002-of-00003.gguf`, ...), mapped as the first is.
    _parts: list[mmap.mmap] = field(default_factory=list, repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 `[*rows, bytes_per_row]` (a view of the mapped file), the
        layout `gguf.quants.dequantize` expects."""
        assert self._mmap is not None
        mm = self._mmap if info.part == 0 else self._parts[info.part - 1]
        buf = np.frombuffer(mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        row = info.shape[-1] if info.shape else 1
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        return buf.reshape(*info.shape[:-1], row // block * type_size)

    def release(self, info: GGUFTensorInfo) -> None:
        """Unmaps the tensor's pages from this process once the loader has its own copy: a mapped
        page read once stays resident (file-backed) until the whole file is closed, so the load
        would otherwise hold the file's bytes beside the weights made from them. The page cache
        keeps them, and a later `raw` of the tensor (or of one sharing an edge page) reads them
        back as a fresh mapping does."""
        mm = self._mmap if info.part == 0 else self._parts[info.part - 1]
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.offset - info.offset % mmap.PAGESIZE
        end = min(len(mm), info.offset + info.nbytes)
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def dequantize(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """`GGUFFile.raw` bytes as float32 `[*rows, elements]`: a float type converted here, a
    quantized one by gguf-py (imported now: see ops/ggml_types for why not before)."""
    t = GGMLQuantizationType(ggml_type)
    if t == GGMLQuantizationType.F32:
        return raw.view(np.float32)
    if t == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32)
    if t == GGMLQuantizationType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(raw, t)


class _Cursor:
    """Sequential little-endian reads over a buffer; every read checks the bounds so that a
    truncated file fails with a message, not a struct error deep inside."""

    __slots__ = ("buf", "pos", "path")

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated GGUF header (needed {n} bytes at offset "
                                 f"{self.pos}, file has {len(self.buf)})")

    def u32(self) -> int:
        self.need(4)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self) -> int:
        self.need(8)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges): `string()`'s reads in one tight
        loop, bounds checked as they go. A tokenizer's arrays hold ~100k strings, read once per
        engine start by the config, the tokenizer and the loader each."""
        buf, pos, end, unpack, out = self.buf, self.pos, len(self.buf), _U64.unpack_from, []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                break
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > end:
                pos -= 8
                break
            append(buf[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        if len(out) < count:
            self.string()  # past the end: raises the truncation error
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.u32(), self.u64()
            if item_type == _STRING:
                return self.strings(count)
            if item_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = _NUMPY_DTYPE.get(item_type)
            if dtype is None:
                raise ModelLoadError(f"{self.path}: unknown GGUF array item type {item_type}")
            nbytes = count * np.dtype(dtype).itemsize
            self.need(nbytes)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += nbytes
            return arr.tolist()
        fmt = _SCALAR_FMT.get(vtype)
        if fmt is None:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype}")
        size = struct.calcsize(fmt)
        self.need(size)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v


_SPLIT = re.compile(r"-00001-of-(\d{5})\.gguf$")


def read_gguf(path: str) -> GGUFFile:
    """Parse the header of the GGUF at `path`; tensor data stays mapped, not read. A split GGUF
    (llama.cpp's gguf-split: `x-00001-of-00003.gguf`, named by its first part) is read whole:
    the first part's metadata, every part's tensors."""
    g = _read_one(path)
    count = int(g.metadata.get("split.count", 1) or 1)
    if count > 1:
        match = _SPLIT.search(path)
        if match is None or int(match.group(1)) != count:
            raise ModelLoadError(f"{path}: part of a split GGUF of {count} files: pass its first part "
                                 f"(...-00001-of-{count:05d}.gguf)")
        for i in range(2, count + 1):
            part = _read_one(path[: match.start()] + f"-{i:05d}-of-{count:05d}.gguf")
            assert part._mmap is not None
            g._parts.append(part._mmap)
            for name, info in part.tensors.items():
                info.part = i - 1
                g.tensors[name] = info
    return g


def _read_one(path: str) -> GGUFFile:
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise ModelLoadError(f"{path}: not a GGUF file ({e})") from None
    cur = _Cursor(mm, path)
    cur.need(4)
    if mm[:4] != _MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {bytes(mm[:4])!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.u64(), cur.u64()

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.u32())

    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.u32()
        ne = [cur.u64() for _ in range(n_dims)]
        raw_infos.append((name, ne, cur.u32(), cur.u64()))

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, ne, ggml_type, rel_offset in raw_infos:
        shape = tuple(int(d) for d in reversed(ne))
        numel = int(np.prod(shape)) if shape else 1
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            block, type_size = 1, 0  # unknown type: refused by the loader, which names it
        nbytes = numel // block * type_size
        offset = data_start + rel_offset
        if offset + nbytes > len(mm):
            raise ModelLoadError(f"{path}: tensor {name} ends at byte {offset + nbytes}, past the "
                                 f"end of the file ({len(mm)} bytes); the file is truncated")
        tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, nbytes)
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors, _mmap=mm)
