"""Fresh memory for large plans: arrays without transparent huge pages, their pages mapped ahead.

A plan of 35M candidates fills ~1.9 GB of new arrays, and each 4 KiB page costs a page fault when
it is first written: ~0.5M faults, about a second of system time on the thread that fetches the
candidates. `Prefault` has a second thread ask the kernel to map those pages (madvise
MADV_POPULATE_WRITE, Linux ≥ 5.14) a window of rows ahead of the fetch. It never writes the
arrays, so the two threads need no coordination beyond how far the fetch has got; where the kernel
refuses the call (older kernels, other systems) the thread stops and the faults are taken as before.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import threading
from typing import Any

import numpy as np

try:  # numpy asks the kernel for transparent huge pages for every array of ≥ 4 MB
    from numpy._core.multiarray import _set_madvise_hugepage  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - another numpy
    _set_madvise_hugepage = None

LARGE = 4_000_000  # rows from which arrays skip huge pages (greedy.COMPILED_MIN_ROWS)
_HUGEPAGE_LOCK = threading.Lock()
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>
_PAGE = mmap.PAGESIZE


def empty(n: int, dtype: Any) -> np.ndarray:
    """np.empty(n, dtype), from LARGE rows up without transparent huge pages. On the machines
    measured (most memory holding page cache) a huge page costs a reclaim when first touched: a
    35M-row plan spent 3.6–6.0 s of system time with them and 2.3–2.4 without (side by side, two
    runs each). numpy's setting is process-wide: it is switched off for this allocation only."""
    if n < LARGE or _set_madvise_hugepage is None:
        return np.empty(n, dtype)
    with _HUGEPAGE_LOCK:  # two threads planning at once must not leave the setting off for the process
        before = _set_madvise_hugepage(False)
        try:
            return np.empty(n, dtype)
        finally:
            _set_madvise_hugepage(before)


@functools.cache
def _madvise() -> Any:
    """libc's madvise, or None where there is none to call (looked up once)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


MMAP_THRESHOLD = 1 << 20  # allocations from this size are mapped, and returned when freed (map_large)
_M_MMAP_THRESHOLD = -3  # <malloc.h>


def map_large() -> bool:
    """Have glibc's malloc map every allocation of MMAP_THRESHOLD bytes or more and return it to the
    system when freed (mallopt M_MMAP_THRESHOLD), instead of raising its threshold after the first
    such free and keeping later freed buffers in its heap. Measured on a 20-expert full-read
    DARE-TIES merge of the bench family: the Python and numpy peak is that of a 2-expert one
    (tracemalloc), but glibc's kept buffers made the process peak 15-25 MiB higher; with this, +3%
    (238 -> 245 MiB) and no slower (5.24-5.35 s against 5.34-5.40; below 1 MiB the merge kernels'
    per-call chunk buffers would come back as fresh pages: 7x the page faults, +6% time).
    Process-wide, so only the `mergedb` command calls it, for merges (cli._held_progress); False where
    libc has no mallopt (not glibc)."""
    try:
        f = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    f.argtypes, f.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return f(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


class Prefault:
    """Map the pages of `arrays` (each of ≥ `rows` elements) for rows [0, rows), in row order, at
    most `ahead` rows past what the owner has reported filled (`reached`). Use as a context
    manager: leaving it stops the thread (pages already mapped stay, as the fill's own would)."""

    def __init__(self, arrays: list[np.ndarray], rows: int, ahead: int = 1 << 22, chunk: int = 1 << 18) -> None:
        self._arrays = [a for a in arrays if a.size]
        self._rows, self._ahead, self._chunk = rows, ahead, chunk
        self._reached = 0
        self._wake = threading.Condition()
        self._stop = False
        self.mapped_rows = 0  # how far the thread got (tests, benchmarks)
        self._thread: threading.Thread | None = None
        madvise = _madvise() if self._arrays and rows > 0 else None  # small plans: nothing to map
        if madvise is not None:
            self._thread = threading.Thread(target=self._run, args=(madvise,), name="mergedb-prefault", daemon=True)

    def __enter__(self) -> Prefault:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()

    def reached(self, row: int) -> None:
        """The owner has filled rows [0, row): the thread may map up to row + ahead."""
        with self._wake:
            self._reached = row
            self._wake.notify()

    def _run(self, madvise: Any) -> None:
        lo = 0
        while lo < self._rows:
            with self._wake:
                while not self._stop and lo >= self._reached + self._ahead:
                    self._wake.wait()
                if self._stop:
                    return
            hi = min(lo + self._chunk, self._rows)
            for a in self._arrays:  # the fill writes every column's rows [lo, hi) together
                start = a.ctypes.data + lo * a.itemsize
                end = a.ctypes.data + hi * a.itemsize
                start -= start % _PAGE  # whole pages, all inside the array's own mapping
                end += -end % _PAGE
                if madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
                    return  # not supported here (EINVAL) or not mapped: the fill faults as before
            lo = hi
            self.mapped_rows = hi
