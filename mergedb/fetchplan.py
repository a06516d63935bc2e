"""The byte ranges a merge will read, in the order it reads them, declared to its remote sources.

A remote source coalesces what is declared into few requests and fetches ahead (sources.py);
local sources ignore declarations. The merger reads every tensor of the base in full, in tensor
order, and each selected (expert, block) once, tensor by tensor and block by block.

A merge of local files starts reading before its engine is ready (Prefetch): the first
PREFETCH_BYTES of those ranges go into the page cache while the merge engine starts (numba's
kernels import and load in ~0.2 s where the C kernels cannot be built; the C kernels load in ~1 ms,
and the prefetch's four streams then just read ahead: measured no faster or slower without it,
benchmarks/ANALYSIS.md, twenty-fifth session).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from . import remote
from .checkpoint import PlanInputs
from .layout import block_bytes
from .lora import is_adapter
from .readahead import in_order
from .sources import LocalFile, RemoteFile, declare

if TYPE_CHECKING:
    from .manifest import ExecutionPlan

# What the disk can read while the merge engine starts (numba's import and cache load take ~0.2 s
# of one core where it runs; these disks read 0.5-2 GB/s): more is read by the merger's own threads.
PREFETCH_BYTES = 512 * 2**20
PREFETCH_THREADS = 4  # reads in flight (this virtual disk serves 4 streams 1.7-3x faster than one)
PREFETCH_CHUNK = 8 * 2**20
FD_MARGIN = 64  # file descriptors left free besides the inputs' (DuckDB, the output, the pool)


def declare_merge(xp: ExecutionPlan, inputs: PlanInputs, tensors: Collection[int] | None = None) -> None:
    """Declare every read a merge of `xp` (of its `tensors` only, when given) makes through `inputs`
    (nothing to do when all are local)."""
    if inputs.sources.any_remote:
        declare(merge_reads(xp, inputs, tensors=tensors), concurrent=True)


def merge_reads(
    xp: ExecutionPlan,
    inputs: PlanInputs,
    sel: dict[int, dict[int, list[tuple[int, str]]]] | None = None,
    tensors: Collection[int] | None = None,
) -> Iterator[tuple[LocalFile | RemoteFile, int, int, int]]:
    """(source, offset, length, 1) of each read of the merge, in order: per tensor (of `tensors`
    only, when given), the base's whole tensor, then each selected block's experts in plan order.
    `sel`: xp.selected(), or the part of it for the first tensors when only the first reads are
    wanted (Prefetch)."""
    sel = xp.selected() if sel is None else sel
    only = None if tensors is None else frozenset(tensors)
    for ti, t in enumerate(xp.tensors):
        if only is not None and ti not in only:
            continue
        src, info, _ = inputs.where[0][t.name]
        yield src, info.start, info.nbytes, 1
        if not t.mergeable:
            continue
        for b, work in sorted(sel.get(ti, {}).items()):
            for pos, _ in work:
                if pos in inputs.skip:  # a LoRA adapter: read from its factors (loramerge.py)
                    continue
                esrc, einfo, _ = inputs.where[pos + 1][t.name]
                lo, hi = block_bytes(t, einfo.nbytes, b)
                yield esrc, einfo.start + lo, hi - lo, 1


class Prefetch:
    """Reads the first `limit` bytes of a merge's reads (merge_reads order) into the page cache, on
    its own threads, while the merger is being imported and started; the merger's reads of those
    bytes then come from memory. Local checkpoints only (none when an input is a URL or a LoRA
    adapter). The bytes go from the file to /dev/null by sendfile: no buffer in this process, and
    the GIL is released. A hint: an input it cannot open is left to the merger, which opens the
    same inputs and reports it. `close()` stops it and waits for the reads in flight."""

    def __init__(self, xp: ExecutionPlan, limit: int = PREFETCH_BYTES, threads: int = PREFETCH_THREADS) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(xp, limit, threads), name="mergedb-prefetch")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, xp: ExecutionPlan, limit: int, threads: int) -> None:
        sources = (xp.base, *xp.experts)
        if any(remote.is_url(s.path) or is_adapter(s.path) for s in sources) or not _fds_for(sources):
            return
        try:
            inputs = PlanInputs(xp)
        except Exception:  # a hint: the merger opens the same inputs and reports what is wrong
            return
        try:
            sizes = [inputs.where[0][t.name][1].nbytes for t in xp.tensors]
            last = next((i for i, n in enumerate(itertools.accumulate(sizes)) if n >= limit), len(sizes) - 1)
            chunks = _chunks(merge_reads(xp, inputs, xp.selected(hashes=False, last=last)), limit)
            pool = ThreadPoolExecutor(threads, thread_name_prefix="mergedb-prefetch")
            with pool, open(os.devnull, "wb") as null:
                # a few reads queued per thread: a Future for every read at once (and its work item) was
                # most of a 96 MB traced peak at 16 experts of 2,000 small tensors (33 MB without)
                for _ in in_order(pool, lambda c: self._read(null.fileno(), *c), chunks, 4 * threads):
                    if self._stop.is_set():
                        break
        except Exception:
            pass  # the merger's own reads of these bytes report what is wrong
        finally:
            inputs.close()

    def _read(self, null: int, fd: int, offset: int, n: int) -> None:
        while n > 0 and not self._stop.is_set():
            k = os.sendfile(null, fd, offset, n)
            if k == 0:
                return
            offset, n = offset + k, n - k


def _fds_for(sources: tuple) -> bool:
    """Whether this process may open every input file twice (the prefetch's set, then the merger's)
    and keep a margin under its open-file limit (RLIMIT_NOFILE; often 1024)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return True
        files = 0
        for s in sources:
            p = Path(s.path)
            files += sum(e.name.endswith(".safetensors") for e in os.scandir(p)) if p.is_dir() else 1
        return len(os.listdir("/proc/self/fd")) + 2 * files + FD_MARGIN <= soft
    except (ImportError, OSError):
        return False


def _chunks(reads: Iterator[tuple[LocalFile | RemoteFile, int, int, int]], limit: int) -> Iterator[tuple[int, ...]]:
    """(fd, offset, length) pieces of at most PREFETCH_CHUNK bytes of the first `limit` bytes of `reads`."""
    for src, offset, n, _ in reads:
        if limit <= 0:
            return
        n = min(n, limit)
        limit -= n
        assert isinstance(src, LocalFile)
        for o in range(offset, offset + n, PREFETCH_CHUNK):
            yield src.fd, o, min(PREFETCH_CHUNK, offset + n - o)
