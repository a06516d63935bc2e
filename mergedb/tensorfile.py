"""Safetensors files at the byte level: a strict header parser, ranged reads, a streaming writer.

Layout (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON (`{name: {dtype, shape, data_offsets: [start, end]}, "__metadata__": {...}}`),
then the data; offsets are relative to byte 8 + N and tensors are row-major. Every dtype upstream
knows is read (DTYPE_BITS); the packed sub-byte ones (F4, F6_E2M3, F6_E3M2) take numel * bits / 8
bytes, which must be whole. Keys must be unique in every JSON object of the header (upstream
silently keeps the last of a repeated key; we refuse the file).

This module knows bytes, headers and dtypes; nothing of catalogs or plans. It never trusts a
header beyond what it can check against the file: every claimed size is checked before any
allocation that depends on it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import writeout
from .errors import FormatError, MergeDBError
from .jsondoc import DuplicateKey, no_duplicate_keys
from .plainfile import file_kind, read_exact

# Upstream's MAX_HEADER_SIZE (safetensors/src/tensor.rs): a header of exactly this many bytes is
# accepted, one byte more is refused.
MAX_HEADER_BYTES = 100_000_000

# Bits per element of every dtype upstream's `Dtype` enum lists (safetensors 0.8, 22 names).
# Sub-byte dtypes are packed: a tensor of n elements takes n * bits / 8 bytes, which must be whole.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

# The dtypes whose elements are whole bytes: name -> (bytes per element, numpy dtype of the raw
# bytes, decodable to float32 by `as_float32`?; what mergedb merges is FLOAT_DTYPES). The packed
# sub-byte dtypes (F4, F6_*) have neither an itemsize nor a numpy dtype and are absent: size any
# tensor with `tensor_nbytes`, test a dtype name against DTYPE_BITS.
_DTYPE_KEYS = {k: k for k in DTYPE_BITS}  # a header's dtype string -> the one str object of that name
DTYPES: dict[str, tuple[int, str, bool]] = {
    "F64": (8, "<f8", True),
    "F32": (4, "<f4", True),
    "F16": (2, "<f2", True),
    "BF16": (2, "<u2", True),  # numpy has no bfloat16: raw uint16, widened by shifting
    "C64": (8, "<c8", False),
    "I64": (8, "<i8", False),
    "I32": (4, "<i4", False),
    "I16": (2, "<i2", False),
    "I8": (1, "i1", False),
    "U64": (8, "<u8", False),
    "U32": (4, "<u4", False),
    "U16": (2, "<u2", False),
    "U8": (1, "u1", False),
    "BOOL": (1, "u1", False),
    "F8_E4M3": (1, "u1", False),
    "F8_E5M2": (1, "u1", False),
    "F8_E8M0": (1, "u1", False),
    "F8_E4M3FNUZ": (1, "u1", False),
    "F8_E5M2FNUZ": (1, "u1", False),
}
MAX_RANK = 16  # dimensions of a tensor's shape (the manifest allows as many)
FLOAT_DTYPES = ("BF16", "F16", "F32")  # the dtypes mergedb merges; every other dtype passes through


OUT_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}  # --dtype options
PT_METADATA = {"format": "pt"}  # every shard mergedb writes (transformers reads the format from it)


def normalize_dtype(dtype: str | None) -> str | None:
    """An output dtype option (bf16 | fp16 | fp32, or BF16 | F16 | F32) as a safetensors dtype."""
    if dtype is None:
        return None
    if not isinstance(dtype, str):  # a list was a bare "unhashable" TypeError
        raise MergeDBError(f"an output dtype is bf16, fp16, fp32 or None, got {dtype!r:.60}")
    out = OUT_DTYPES.get(dtype, dtype)
    if out not in OUT_DTYPES.values():
        raise MergeDBError(f"unknown --dtype {dtype!r}; use bf16, fp16 or fp32")
    return out


def tensor_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes of a tensor of `dtype` and `shape`: numel * bits / 8, as upstream computes it.

    Raises FormatError for an unknown dtype, and for a packed sub-byte tensor whose elements do not
    fill a whole number of bytes (upstream refuses those too).
    """
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise FormatError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BITS)}")
    total = math.prod(shape) * bits
    if total % 8:
        raise FormatError(
            f"{math.prod(shape)} elements of the {bits}-bit dtype {dtype} (shape {list(shape)}) are "
            f"{total} bits, not a whole number of bytes; packed tensors must fill whole bytes"
        )
    return total // 8


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's entry in a safetensors header; `start`/`end` are absolute file offsets. No __dict__,
    strings and shapes shared (parse_header): a registration holds one per tensor of every checkpoint."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bits(self) -> int:
        """Bits per element (4 and 6 for the packed dtypes)."""
        return DTYPE_BITS[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per element; only for dtypes in DTYPES (KeyError for packed F4/F6_*: use `bits`)."""
        return DTYPES[self.dtype][0]

    @property
    def rows_aligned(self) -> bool:
        """Whether each dim-0 row starts on a byte boundary, so the tensor can be split by rows.

        Always true for tensors of rank < 2 (their one "row" is the whole tensor) and for
        whole-byte dtypes; a packed F4/F6 tensor only when a row's elements fill whole bytes.
        """
        return len(self.shape) < 2 or (math.prod(self.shape[1:]) * self.bits) % 8 == 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row; the whole tensor's bytes for 0-d and 1-d tensors and for packed
        tensors whose rows are not whole bytes (`rows_aligned` false): those are one block."""
        if not self.rows_aligned or len(self.shape) <= 1:
            return self.nbytes
        return (math.prod(self.shape[1:]) * self.bits) // 8

    @property
    def is_float(self) -> bool:
        """Mergeable: one of FLOAT_DTYPES (F64, FP8 and the packed floats pass through)."""
        return self.dtype in FLOAT_DTYPES


@dataclass(frozen=True)
class Header:
    """A parsed, validated header: tensors in file order, plus the free-form metadata."""

    path: Path | str  # a URL for a remote file
    header_len: int
    file_size: int
    sha256: str
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def read_header(path: str | os.PathLike[str]) -> Header:
    """Parse and validate the header of the safetensors file at `path`.

    Reads only the header's bytes (FADV_RANDOM: no kernel readahead into the tensor data, which
    would otherwise count as physical reads of blocks a plan never selects).
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise FormatError(f"{path}: is a folder, expected a .safetensors file") from None
    except PermissionError as e:
        raise FormatError(f"{path}: cannot be read ({e.strerror}); check its permissions") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise FormatError(f"{path}: is a folder, expected a .safetensors file")
        if not stat.S_ISREG(mode):
            raise FormatError(f"{path}: is {file_kind(mode)}, not a regular file; expected a .safetensors file")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return parse_header(lambda n, offset: read_exact(fd, n, offset), path, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def parse_header(read: Callable[[int, int], bytes], path: Path | str, size: int) -> Header:
    """Parse and validate the header of the `size`-byte file at `path` (a local path or a URL), whose
    bytes `read(n, offset)` returns: two reads, the 8-byte length and then the JSON."""
    bad = f"{path}: not a valid safetensors file"
    if size < 8:
        raise FormatError(f"{bad}: {size} bytes is too short for the 8-byte header length (truncated?)")
    (n,) = struct.unpack("<Q", read(8, 0))
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{bad}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > size:
        raise FormatError(f"{bad}: header length {n} runs past the end of the {size}-byte file (truncated?)")
    raw = read(n, 8)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as e:
        raise FormatError(
            f"{bad}: key {e.key!r} appears more than once in the header (JSON readers silently keep the last "
            "one, so tools disagree on what this file holds); re-export the checkpoint with one entry per tensor"
        ) from None
    except ValueError as e:  # not UTF-8, not JSON, or an integer of over 4300 digits
        raise FormatError(f"{bad}: header is not valid JSON ({e})") from None
    except RecursionError:
        raise FormatError(f"{bad}: header JSON nests too deeply") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{bad}: header must be a JSON object, got {type(doc).__name__}")
    metadata = doc.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # as safetensors: null or an object, nothing else
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{bad}: __metadata__ must map strings to strings")
    data_start = 8 + n
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per distinct shape of the file
    tensors = [_entry(bad, name, spec, data_start, shapes) for name, spec in doc.items()]
    tensors.sort(key=lambda t: (t.start, t.end, t.name))
    cursor = data_start
    for t in tensors:
        if t.start != cursor:
            what = "overlaps the previous tensor" if t.start < cursor else "leaves a gap before it"
            raise FormatError(f"{bad}: tensor {t.name!r} at data offset {t.start - data_start} {what}")
        cursor = t.end
    if cursor != size:
        if cursor > size:
            raise FormatError(f"{bad}: tensor data runs to byte {cursor} but the file has {size} bytes (truncated?)")
        raise FormatError(f"{bad}: {size - cursor} bytes after the last tensor are not described by the header")
    return Header(path, n, size, hashlib.sha256(raw).hexdigest(), tuple(tensors), dict(metadata))


def _entry(
    bad: str, name: Any, spec: Any, data_start: int, shapes: dict[tuple[int, ...], tuple[int, ...]]
) -> TensorInfo:
    if not isinstance(name, str) or not name or "\x00" in name:
        raise FormatError(f"{bad}: tensor name {name!r} is empty or contains NUL")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, written as a \ud800 escape
        raise FormatError(f"{bad}: tensor name {name!r} is not valid Unicode (a lone surrogate)") from None
    if not isinstance(spec, dict):
        raise FormatError(f"{bad}: entry for tensor {name!r} must be an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise FormatError(f"{bad}: tensor {name!r} has unknown dtype {dtype!r}; known: {', '.join(DTYPE_BITS)}")
    if (
        not isinstance(shape, list)
        or not all(type(d) is int and 0 <= d < 2**63 for d in shape)
        or len(shape) > MAX_RANK
    ):
        raise FormatError(f"{bad}: tensor {name!r} has invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and 0 <= o for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise FormatError(f"{bad}: tensor {name!r} has invalid data_offsets {offsets!r}")
    try:
        expected = tensor_nbytes(dtype, shape)
    except FormatError as e:
        raise FormatError(f"{bad}: tensor {name!r}: {e} (upstream refuses it too); re-export the checkpoint") from None
    if offsets[1] - offsets[0] != expected:
        raise FormatError(
            f"{bad}: tensor {name!r} of shape {shape} and dtype {dtype} needs {expected} bytes "
            f"but data_offsets {offsets} span {offsets[1] - offsets[0]}"
        )
    # a family's checkpoints name the same tensors: names interned, dtypes and shapes one object each
    dims = tuple(shape)
    dims = shapes.setdefault(dims, dims)
    return TensorInfo(sys.intern(name), _DTYPE_KEYS[dtype], dims, data_start + offsets[0], data_start + offsets[1])


def pread_into(fd: int, buf: memoryview, offset: int, path: str | os.PathLike[str] = "") -> None:
    """Fill `buf` with the bytes at `offset`; short reads are retried, EOF is an error."""
    done, total = 0, len(buf)
    while done < total:
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise FormatError(f"{path}: file ended at byte {offset + done}, expected {total - done} more (truncated?)")
        done += got


def as_float32(raw: np.ndarray, dtype: str, out: np.ndarray) -> np.ndarray:
    """Decode raw element bytes (viewed with DTYPES' numpy dtype) into the float32 buffer `out`."""
    if dtype == "BF16":
        np.left_shift(raw, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        out[...] = raw
    return out


@dataclass(frozen=True)
class FileRange:
    """`nbytes` at `offset` of the open file `fd` (`path`): a tensor to copy file to file unread."""

    fd: int
    path: str
    offset: int
    nbytes: int


_NO_COPY_RANGE = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}  # copy_file_range cannot here


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor: header first, then data in header order.

    Usage: `with SafetensorsWriter(path, entries) as w: w.write(name, buffer) ...` where entries are
    `(name, dtype, shape)` in the order they will be written. Closing fsyncs; a missing or
    mis-sized tensor raises instead of leaving a file that looks complete.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        self._expected: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            try:
                nbytes = tensor_nbytes(dtype, shape)
            except FormatError as e:
                raise MergeDBError(f"{self.path}: cannot write tensor {name!r}: {e}") from None
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, nbytes))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes, as safetensors does
        self.total_size = offset
        self._next = 0
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._started = 0  # bytes before this offset were handed to writeout.start

    def _write_behind(self, end: int) -> None:
        """Start the write-out of what was written up to `end` once WRITE_BEHIND bytes are waiting."""
        if end - self._started >= writeout.WRITE_BEHIND:
            self._file.flush()
            writeout.start(self._file.fileno(), self._started, end - self._started)
            self._started = end

    def write(self, name: str, data: bytes | memoryview | np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
        self._check(name, view.nbytes)
        self._file.write(view)
        self._next += 1
        self._write_behind(self._file.tell())

    def _check(self, name: str, nbytes: int) -> None:
        if self._next >= len(self._expected) or self._expected[self._next][0] != name:
            want = self._expected[self._next][0] if self._next < len(self._expected) else "nothing"
            raise MergeDBError(f"{self.path}: wrote tensor {name!r} out of order, expected {want!r}")
        if nbytes != self._expected[self._next][1]:
            raise MergeDBError(
                f"{self.path}: tensor {name!r} has {nbytes} bytes, header says {self._expected[self._next][1]}"
            )

    def copy(self, name: str, src: FileRange) -> None:
        """Write tensor `name` as the bytes of `src`, copied by the kernel (os.copy_file_range: a reflink
        on XFS/btrfs); read and written in chunks where the file systems cannot."""
        fd, offset, nbytes = src.fd, src.offset, src.nbytes
        self._check(name, nbytes)
        self._file.flush()
        dst, at = self._file.fileno(), self._file.tell()
        done = 0
        try:
            while done < nbytes:
                got = os.copy_file_range(fd, dst, nbytes - done, offset + done, at + done)
                if got == 0:  # some file systems answer 0 for "not here": the chunked copy says if it is the end
                    break
                done += got
        except OSError as e:  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: no in-kernel copy between these files
            if e.errno not in _NO_COPY_RANGE:
                raise
        if done < nbytes:
            _copy_chunked(src, dst, done, at)
        if os.fstat(dst).st_size < at + nbytes:
            raise MergeDBError(f"{self.path}: tensor {name!r} was not written whole (disk full?)")
        self._file.seek(at + nbytes)
        self._next += 1
        self._write_behind(at + nbytes)

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            if self._next != len(self._expected):
                missing = self._expected[self._next][0]
                raise MergeDBError(f"{self.path}: closed before tensor {missing!r} was written")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def abort(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _copy_chunked(src: FileRange, dst: int, done: int, at: int) -> None:
    """Copy src's bytes from `done` on to `dst` at `at + done` through a buffer (pread_into names a
    truncated source); pwrite may write part of a chunk: the rest is written next."""
    chunk = np.empty(min(src.nbytes - done, 16 * 2**20), np.uint8)
    for lo in range(done, src.nbytes, len(chunk)):
        part = memoryview(chunk)[: min(len(chunk), src.nbytes - lo)]
        pread_into(src.fd, part, src.offset + lo, src.path)
        pos = at + lo
        while part.nbytes:
            n = os.pwrite(dst, part, pos)  # short when the disk fills up; ENOSPC raises
            if n == 0:
                raise OSError(errno.EIO, f"wrote nothing of {part.nbytes} bytes at offset {pos}")
            part, pos = part[n:], pos + n
