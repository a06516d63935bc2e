"""The C kernels' arguments (native.py's wrappers): numpy arrays checked against every element the C
code will touch, then passed as raw addresses; numbers checked against the C type they become.

C indexes raw memory where numba clips a slice, wraps an index or refuses a type, and ctypes silently
truncates an int to a C int. So every array is checked for its dtype, its exact number of dimensions,
the extents the kernel indexes, its layout (the last axis contiguous, the others whole elements apart,
aligned) and, for an output, that it is writable; every int for its range (tests/test_kernelargs.py
tries the merge kernels' refusals, tests/test_regkernels.py registration's).
"""

from __future__ import annotations

from typing import Any

import numpy as np

RAW = (np.uint16, np.uint32)  # raw element bits: BF16 and F16, or F32 (or any dtype's float32 bits)


def array(a: Any, dtype: Any, shape: tuple[int | None, ...], what: str, write: bool = False) -> int:
    """The address of `a`, a kernel's view of which spans `shape` (the least extent of each axis; None:
    any): of `dtype`, with exactly len(shape) dimensions, its last axis contiguous and the other axes
    whole elements apart (a row stride may be negative: C steps rows by it), aligned; writable if `write`.
    Plain loops, not generators: it runs for every array of every block's kernel call (~1.7 µs)."""
    try:
        dt, have, steps, size = a.dtype, a.shape, a.strides, a.itemsize
    except AttributeError:
        raise TypeError(f"{what}: a numpy array is expected, not {type(a).__name__}") from None
    if dt != dtype and dtype is not None:
        raise TypeError(f"{what}: dtype {dt}, where {np.dtype(dtype)} is expected")
    short = len(have) != len(shape)
    for h, need in zip(have, shape):
        if need is not None and h < need:
            short = True
    if short:
        want = ", ".join("any" if s is None else f"≥ {s}" for s in shape)
        raise ValueError(f"{what}: shape {have}, where ({want}) is expected")
    if a.size:
        flags = a.flags
        for step in steps:
            if step % size:
                raise ValueError(f"{what}: rows not whole elements apart")
        if have[-1] > 1 and steps[-1] != size:
            raise ValueError(f"{what}: rows that are not contiguous")
        if not flags.aligned:
            raise ValueError(f"{what}: elements that are not aligned")
        if write and not flags.writeable:  # numba refuses to compile a store into a read-only array
            raise ValueError(f"{what}: a kernel output that is read-only")
    return a.ctypes.data


def raw(a: Any, shape: tuple[int | None, ...], what: str) -> tuple[int, int]:
    """(address, wide) of raw element bits spanning `shape` (`array`): uint16, or uint32 (wide)."""
    if getattr(a, "dtype", None) not in RAW:
        raise TypeError(f"{what}: raw element bits of dtype {getattr(a, 'dtype', type(a).__name__)}, where uint16 "
                        "or uint32 is expected")  # fmt: skip
    return array(a, a.dtype, shape, what), int(a.dtype == np.uint32)


def stride(a: np.ndarray, axis: int = 0) -> int:
    """Axis `axis`'s stride in elements (`array` has checked it is a whole number of them)."""
    return a.strides[axis] // a.itemsize


def whole_number(x: Any, lo: int, hi: int, what: str) -> int:
    """`x` as an int in [lo, hi): a C int or uint64 would keep only its low bits."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not lo <= int(x) < hi:
        raise ValueError(f"{what}: {x!r}, where a whole number from {lo} to {hi - 1} is expected")
    return int(x)


def whole(a: np.ndarray, dtype: Any, write: bool = False) -> int:
    """The address of all of `a` for registration's C kernels: C-ordered (any dimensions: C indexes it
    as one run of elements), aligned, of `dtype`; writable if `write`."""
    if a.dtype != dtype:
        raise TypeError(f"a kernel argument of dtype {a.dtype}, where {np.dtype(dtype)} is expected")
    if not a.flags.c_contiguous or not a.flags.aligned:
        raise ValueError("a kernel argument that is not one aligned run of elements in C order")
    return array(a, dtype, (None,) * a.ndim, "a kernel argument", write)


def ranges(start: np.ndarray, length: int, what: str) -> tuple[int, int]:
    """(blocks, end) of block boundaries `start` (int64, ascending from 0 or more) within `length`."""
    if start.dtype != np.int64 or start.ndim != 1 or start.shape[0] < 1:
        raise TypeError(f"{what}: one-dimensional int64 boundaries are expected, not {start.dtype} {start.shape}")
    if start[0] < 0 or start[-1] > length or bool((np.diff(start) < 0).any()):
        raise ValueError(f"{what}: boundaries that are not ascending from 0 or more within {length}")
    return start.shape[0] - 1, int(start[-1])
