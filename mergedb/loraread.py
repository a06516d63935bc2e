"""Reading a LoRA adapter's factors and forming its delta one block of rows at a time.

In the base tensor's orientation ΔW = s · L @ R (lora.LoraFactor): a block of rows [r0, r1)
needs rows r0..r1 of L, which are rows of B (one contiguous range) or, for a transposed factor
(fan_in_fan_out, embedding), columns r0..r1 of A (one range per rank), plus R whole. Bytes read
for a block are therefore exactly (r1 − r0) · rank · itemsize, and R's bytes once per tensor.

The product is summed in float64 in a fixed order (k = 0 … r−1 per element, numba), times s,
rounded once to float32: the same bytes on any machine and thread count (a BLAS sgemm may split
its sums differently per CPU and thread count).
"""

from __future__ import annotations

import os

import numpy as np

from .jitload import numba  # imported with Ctrl-C held
from .lora import Adapter, LoraFactor
from .tensorfile import DTYPES, TensorInfo, as_float32, pread_into


class AdapterFiles:
    """Open file descriptors of an adapter's safetensors files (`close` when done)."""

    def __init__(self, adapter: Adapter, random_access: bool = True) -> None:
        self.paths = [adapter.root / f.relpath for f in adapter.files]
        self.fds: list[int] = []
        try:
            for p in self.paths:
                fd = os.open(p, os.O_RDONLY)
                self.fds.append(fd)
                if random_access:  # no kernel readahead past the ranges asked for
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def read(self, where: tuple[int, TensorInfo], offset: int, nbytes: int, out: np.ndarray) -> np.ndarray:
        """Bytes [offset, offset + nbytes) of tensor `where`'s data into `out` (uint8)."""
        fi, t = where
        buf = out[:nbytes]
        pread_into(self.fds[fi], memoryview(buf), t.start + offset, self.paths[fi])
        return buf


def _decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    return as_float32(raw.view(DTYPES[dtype][1]), dtype, np.empty(raw.nbytes // DTYPES[dtype][0], np.float32))


def read_fixed(files: AdapterFiles, f: LoraFactor) -> tuple[np.ndarray, np.ndarray]:
    """R (rank, cols) float32 (A, or Bᵀ when transposed) and the raw bytes read for it (the
    factor's bytes, once)."""
    t = f.fixed_factor[1]
    raw = files.read(f.fixed_factor, 0, t.nbytes, np.empty(t.nbytes, np.uint8))
    return fixed_from_raw(f, raw), raw


def fixed_from_raw(f: LoraFactor, raw: np.ndarray) -> np.ndarray:
    """R (rank, cols) float32 from the fixed factor's raw bytes."""
    t = f.fixed_factor[1]
    x = _decode(raw, t.dtype).reshape(t.shape)  # A (r, cols) or B (cols, r)
    return np.ascontiguousarray(x.T) if f.transposed else x


def read_rows(files: AdapterFiles, f: LoraFactor, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
    """L[r0:r1] (rows, rank) float32 (rows of B, or columns of A when transposed), and the raw
    bytes read for it (rows × rank × itemsize: the block's read cost)."""
    _, t = f.rows_factor
    size = DTYPES[t.dtype][0]
    rows, rank = r1 - r0, f.rank
    raw = np.empty(rows * rank * size, np.uint8)
    if not f.transposed:  # B (out, r): rows r0..r1 are one range
        files.read(f.rows_factor, r0 * rank * size, rows * rank * size, raw)
        return _decode(raw, t.dtype).reshape(rows, rank), raw
    cols = t.shape[1]  # A (r, cols): columns r0..r1 of each of its r rows
    for k in range(rank):
        seg = raw[k * rows * size : (k + 1) * rows * size]
        files.read(f.rows_factor, (k * cols + r0) * size, rows * size, seg)
    return np.ascontiguousarray(_decode(raw, t.dtype).reshape(rank, rows).T), raw


@numba.njit(nogil=True, cache=True)
def _product(left, right, scale, out):  # pragma: no cover - compiled
    # out[i, j] = float32(scale · Σ_k float64(left[i, k]) · float64(right[k, j])), k ascending
    rows, rank = left.shape
    cols = right.shape[1]
    acc = np.empty(cols, np.float64)
    for i in range(rows):
        acc[:] = 0.0
        for k in range(rank):
            a = np.float64(left[i, k])
            for j in range(cols):
                acc[j] += a * np.float64(right[k, j])
        for j in range(cols):
            out[i, j] = np.float32(scale * acc[j])


def delta_rows(f: LoraFactor, left: np.ndarray, right: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ΔW rows (rows, cols) float32 = scale · left @ right, from `read_rows` and `read_fixed`."""
    if out is None:
        out = np.empty((left.shape[0], right.shape[1]), np.float32)
    _product(left, right, np.float64(f.scale), out)
    return out


def dense_rows(
    files: AdapterFiles, where: tuple[int, TensorInfo], shape: tuple[int, ...], r0: int, r1: int, out: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows r0..r1 of a modules_to_save tensor of `shape`, decoded to float32 into `out` (flat), and
    the raw bytes read for them."""
    t = where[1]
    rb = t.nbytes // shape[0] if len(shape) > 1 else t.nbytes  # bytes per row of the replacement
    raw = files.read(where, r0 * rb, (r1 - r0) * rb, np.empty((r1 - r0) * rb, np.uint8))
    return as_float32(raw.view(DTYPES[t.dtype][1]), t.dtype, out), raw


def full_delta(adapter: Adapter, name: str) -> np.ndarray:
    """The whole ΔW of LoRA-adapted tensor `name` (rows, cols) float32, in the base's orientation.
    For tests and small tensors: the merge and registration form it one block at a time."""
    f = adapter.factors[name]
    files = AdapterFiles(adapter, random_access=False)
    try:
        right, _ = read_fixed(files, f)
        rows = f.rows_factor[1].shape[1] if f.transposed else f.rows_factor[1].shape[0]
        return delta_rows(f, read_rows(files, f, 0, rows)[0], right)
    finally:
        files.close()
