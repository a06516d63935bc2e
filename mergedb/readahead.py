"""What registration's scan reads, unit by unit, and asking for it ahead.

The scan (scan.py) runs (expert, tensor) units in a fixed order, each reading its expert's tensor
block by block, and the first unit of each tensor reading the base's too. Remote sources are told
every read up front (unit_reads, for sources.declare: coalesced requests fetched ahead); local
files are asked of the kernel a few units ahead (ReadAhead: POSIX_FADV_WILLNEED), so a unit's first
blocks are in the page cache when it starts instead of a disk round trip away. The units themselves
go to the worker threads a bounded window ahead of the one whose result is taken (in_order).
"""

from __future__ import annotations

import operator
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

import numpy as np

from .layout import FamilyTensor
from .sources import LocalFile, RemoteFile

Unit = tuple[int, FamilyTensor]  # (expert index, tensor)
Read = tuple[LocalFile | RemoteFile, int, int]  # (source, offset, bytes)
T = TypeVar("T")
R = TypeVar("R")

READ_AHEAD_BYTES = 256 * 2**20  # file bytes asked for beyond the unit that starts (page cache, not RSS)


class Units(Sequence[Unit]):
    """The scan's (expert, tensor) units in the order they run: the tensors of `order` one after
    another, each with its `experts` units together (expert 0 first). Made when asked for: a list of
    them held 64 bytes per unit (20 MB for 16 experts of 20,000 tensors)."""

    def __init__(self, order: Sequence[FamilyTensor], experts: int) -> None:
        self.order, self.experts = order, experts

    @classmethod
    def scan_order(cls, family: Sequence[FamilyTensor], experts: int) -> Units:
        """scan._scan's order: the largest tensor first (then by index), so that the tail where one
        thread finishes a large tensor alone is one small unit long."""
        return cls(sorted(family, key=lambda ft: (-ft.nbytes, ft.tensor_idx)), experts)

    def __len__(self) -> int:
        return len(self.order) * self.experts

    def __getitem__(self, i: int) -> Unit:  # type: ignore[override]  # (no slices: nothing asks for them)
        i = operator.index(i)  # a slice: TypeError
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return i % self.experts, self.order[i // self.experts]

    def __iter__(self) -> Iterator[Unit]:
        return ((k, ft) for ft in self.order for k in range(self.experts))


class ReadAhead:
    """Asks the kernel to read the scan's files ahead of its units (POSIX_FADV_WILLNEED; remote
    sources fetch their declared reads ahead already): when a unit starts, every unit after it that
    begins within READ_AHEAD_BYTES of its end, and at least the next one, each asked for once. A
    unit's first blocks are then in memory when it starts instead of a disk round trip away, and the
    disk is kept busy while both cores compute. A tensor's first unit asks for the base's bytes too
    (the units of a tensor share them, scan._Shared). `units` in the order they run; the files and
    `where`s as scan._scan holds them. It keeps 17 bytes per unit (a list of reads and a dict entry
    per unit were ~290: 93 MB for 16 experts of 20,000 tensors); a unit's reads are looked up when
    it is asked for."""

    def __init__(
        self, units: Sequence[Unit], bfiles: Any, bwhere: dict, expert_files: Sequence[Any], ewhere: list
    ) -> None:
        self.units, self.bfiles, self.bwhere = units, bfiles, bwhere
        self.expert_files, self.ewhere = expert_files, ewhere
        n_experts = 1 + max((k for k, _ in units), default=-1)
        n_tensors = 1 + max((ft.tensor_idx for _, ft in units), default=-1)
        self.index = np.full((n_experts, n_tensors), -1, np.int64)  # (expert, tensor) -> the unit's place in `units`
        self.first = np.zeros(len(units), bool)  # the unit is its tensor's first: it asks for the base's bytes too
        seen = np.zeros(n_tensors, bool)
        nbytes = np.zeros(len(units), np.int64)
        for i, (k, ft) in enumerate(units):
            self.index[k, ft.tensor_idx] = i
            nbytes[i] = ewhere[k][ft.name][1].nbytes
            if not seen[ft.tensor_idx]:
                seen[ft.tensor_idx] = self.first[i] = True
                nbytes[i] += bwhere[ft.name][1].nbytes
        self.end = np.cumsum(nbytes)  # bytes up to each unit's end
        self.asked = 0  # units asked for so far
        self.lock = threading.Lock()

    def _reads(self, i: int) -> list[Read]:
        k, ft = self.units[i]
        efi, et = self.ewhere[k][ft.name]
        reads = [(self.expert_files[k].src[efi], et.start, et.nbytes)]
        if self.first[i]:
            bfi, bt = self.bwhere[ft.name]
            reads.append((self.bfiles.src[bfi], bt.start, bt.nbytes))
        return reads

    def started(self, k: int, ft: FamilyTensor) -> None:
        """Unit (k, ft) starts: ask for it and the units after it not asked for yet (outside the lock:
        a unit whose bytes another thread is still asking for reads them itself, just as correctly)."""
        i = int(self.index[k, ft.tensor_idx]) if k < self.index.shape[0] and ft.tensor_idx < self.index.shape[1] else -1
        if i < 0:
            raise KeyError((k, ft.tensor_idx))  # not a unit of this scan
        with self.lock:
            lo = self.asked
            hi = max(lo, i + 2)
            limit = self.end[i] + READ_AHEAD_BYTES
            while hi < len(self.units) and self.end[hi - 1] < limit:
                hi += 1
            hi = min(hi, len(self.units))
            self.asked = hi
        for j in range(lo, hi):
            for src, offset, n in self._reads(j):
                src.will_need(offset, n)


def unit_reads(
    units: Sequence[Unit], bfiles: Any, bwhere: dict, expert_files: Sequence[Any], ewhere: list
) -> Iterator[tuple[LocalFile | RemoteFile, int, int, int]]:
    """(source, offset, length, times) of every block scan.scan_experts reads, in the order its units
    run, for sources.declare: each expert's blocks once, the base's blocks once (the first unit of a
    tensor reads them; scan._Shared keeps them for the others)."""
    seen = set()
    for k, ft in units:
        efi, et = ewhere[k][ft.name]
        yield from ((expert_files[k].src[efi], et.start + b.byte_start, b.nbytes, 1) for b in ft.blocks)
        if ft.tensor_idx not in seen:
            seen.add(ft.tensor_idx)
            bfi, bt = bwhere[ft.name]
            yield from ((bfiles.src[bfi], bt.start + b.byte_start, b.nbytes, 1) for b in ft.blocks)


def in_order(pool: Executor, fn: Callable[[T], R], items: Iterable[T], window: int) -> Iterator[R]:
    """pool.map(fn, items), with at most `window` items submitted and not yet yielded. Executor.map
    submits every item at once: a Future (about 1 KB) per (expert, tensor) unit alive for the whole
    scan, holding each finished unit's rows until the caller takes them, which grows with experts ×
    tensors. Pending items are cancelled when the caller stops (an error, Ctrl-C)."""
    todo = iter(items)
    pending: deque[Future[R]] = deque(pool.submit(fn, x) for _, x in zip(range(window), todo))
    try:
        while pending:
            result = pending.popleft().result()
            for x in todo:  # one in for each one out
                pending.append(pool.submit(fn, x))
                break
            yield result
    finally:
        for f in pending:
            f.cancel()
