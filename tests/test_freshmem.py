"""freshmem.Prefault maps a large plan's fresh arrays ahead of the fetch without touching their contents."""

import os
import resource
import subprocess
import sys
import time

import numpy as np
import pytest

from mergedb import freshmem

NEW_KERNEL = sys.platform.startswith("linux") and tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (5, 14)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not NEW_KERNEL, reason="MADV_POPULATE_WRITE needs Linux ≥ 5.14")
def test_prefault_maps_the_pages_so_filling_them_faults_no_more():
    rows = 1 << 23  # 64 MiB of float64 and 8 MiB of bool: 18k pages
    a, b = freshmem.empty(rows, np.float64), freshmem.empty(rows, np.bool_)
    a[:100], b[:100] = 7.5, True  # written before: the thread must leave them alone
    with freshmem.Prefault([a, b], rows, ahead=rows) as p:
        p.reached(100)
        deadline = time.monotonic() + 30
        while p.mapped_rows < rows and time.monotonic() < deadline:  # leaving the block stops the thread
            time.sleep(0.01)
    assert p.mapped_rows == rows
    assert a[:100].tolist() == [7.5] * 100 and b[:100].all()
    before = _faults()
    a[100:] = 1.0
    b[100:] = False
    assert _faults() - before < 200  # without the thread: ~18k faults, one per 4 KiB page


def test_prefault_stays_a_window_ahead_of_the_fill():
    """Rows beyond reached + ahead are not mapped (a plan may read fewer rows than it reserved)."""
    rows = 1 << 22
    a = freshmem.empty(rows, np.int64)
    with freshmem.Prefault([a], rows, ahead=1 << 18, chunk=1 << 16) as p:
        deadline = time.monotonic() + 30  # the thread maps (1 << 18) rows, then waits for the fill
        while NEW_KERNEL and p.mapped_rows < 1 << 18 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # and maps no further
    if NEW_KERNEL:
        assert p.mapped_rows == 1 << 18
    else:
        assert p.mapped_rows in (0, 1 << 18)


KEPT_AFTER_FREE = r"""
import ctypes, sys
from mergedb import freshmem
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "map_large":
    assert freshmem.map_large()
p = libc.malloc(4 << 20)
libc.free(p)  # glibc's default: its mmap threshold rises to this size
before = rss()
bufs = [libc.malloc(1536 << 10) for _ in range(40)]  # 60 MiB of buffers, each written
for b in bufs:
    ctypes.memset(b, 1, 1536 << 10)
pin = libc.malloc(200 << 10)  # a live allocation after them
for b in bufs:
    libc.free(b)
print((rss() - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_map_large_returns_freed_large_buffers_to_the_system():
    """glibc keeps freed buffers of a size it once mapped in its heap (a merge's process then holds
    memory that grows with K, benchmarks/ANALYSIS.md); after map_large they are mapped and returned."""
    kept = {}
    for mode in ("default", "map_large"):
        r = subprocess.run([sys.executable, "-c", KEPT_AFTER_FREE, mode], capture_output=True, text=True, check=True)
        kept[mode] = int(r.stdout)
    assert kept["default"] >= 50 and kept["map_large"] <= 5, kept


def test_only_the_mergedb_process_changes_the_allocator_and_only_for_merges(monkeypatch):
    from mergedb import cli

    calls = []
    monkeypatch.setattr(freshmem, "map_large", lambda: calls.append(1) or True)
    monkeypatch.setattr(cli, "_hold_collector", lambda: lambda: None)  # no gc.freeze in the test process
    for process, label, want in ((False, "merge", 0), (True, "register", 0), (True, "merge", 1), (True, "sweep", 2)):
        monkeypatch.setattr(cli, "_PROCESS", process)
        with cli._held_progress(True, label):
            pass
        assert len(calls) == want, (process, label)
