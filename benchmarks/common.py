"""Helpers shared by the benchmarks: cold-cache eviction, timing, machine description, results."""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from pathlib import Path

# MERGEDB_BENCH_DIR redirects results and cache (the test of --quick writes under tmp_path).
_ROOT = Path(os.environ["MERGEDB_BENCH_DIR"]) if os.environ.get("MERGEDB_BENCH_DIR") else Path(__file__).parent
RESULTS = _ROOT / "results"
CACHE = _ROOT / "cache"


def evict(paths) -> None:
    """Drop files from the page cache (no root needed) so the next read is cold."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def compiled(tree: Path | None = None) -> None:
    """Write the bytecode of the mergedb package a benchmark's processes run (`tree`'s, or this
    checkout's), as every installed mergedb has it after its first import. Machines that set
    PYTHONDONTWRITEBYTECODE=1 (this one does) otherwise compile mergedb's sources in every process:
    ~60 ms of an `execute` process's fixed start (2026-12-03), a cost no user pays twice. Files that
    are up to date are left; call it before the clock starts."""
    import compileall

    compileall.compile_dir(str((tree or Path(__file__).parent.parent) / "mergedb"), quiet=2)


def read_bytes() -> int:
    """Bytes this process fetched from storage so far (the executor's own counter)."""
    from mergedb.executor import physical_read_bytes

    return physical_read_bytes()


def sequential_read(paths, chunk: int = 16 * 2**20) -> tuple[int, float]:
    """Plain sequential read of `paths` (cold): (bytes, seconds)."""
    evict(paths)
    buf = bytearray(chunk)
    t0, n = time.perf_counter(), 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                n += got
    return n, time.perf_counter() - t0


def sequential_write(path: Path, nbytes: int, chunk: int = 16 * 2**20) -> float:
    """Write `nbytes` to a new file `path` in `chunk`-sized writes, fsync it, delete it: seconds for
    writing and syncing (what an execution does with its output before installing it). The bytes are
    random (a device or filesystem that compresses or skips zeros would flatter zeros)."""
    buf = os.urandom(chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0, left = time.perf_counter(), nbytes
        while left > 0:
            left -= os.write(fd, memoryview(buf)[: min(chunk, left)])
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def machine() -> dict:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"),
    }


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def save(name: str, doc: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **doc}, indent=2) + "\n")
    return path
