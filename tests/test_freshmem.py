"""freshmem.Prefault maps a large plan's fresh arrays ahead of the fetch without touching their contents."""

import os
import resource
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
