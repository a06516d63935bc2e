"""What `mergedb execute` does to start sooner: the first bytes read while the merge engine loads
(fetchplan.Prefetch), cached kernels loaded without numba's full refresh (jitload.py)."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mergedb import fetchplan, jitload
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _expected_reads(xp) -> list[tuple[str, int, int]]:
    """(file, offset, length) of every read of a merge, in its order, from the safetensors headers
    and the plan's mask alone: per tensor, the base's whole tensor, then each selected block (block
    order) of each expert (plan order)."""
    files = [Path(s.path) / "model.safetensors" for s in (xp.base, *xp.experts)]
    heads = [_header(f) for f in files]
    sel: dict[int, dict[int, list[int]]] = {}
    for pos, ti, b in zip(*(xp.mask.column(c).to_pylist() for c in ("position", "tensor_idx", "block_idx"))):
        sel.setdefault(ti, {}).setdefault(b, []).append(pos)
    out = []
    for ti, t in enumerate(xp.tensors):
        data, head = heads[0]
        lo, hi = head[t.name]["data_offsets"]
        out.append((str(files[0]), data + lo, hi - lo))
        row_bytes = (hi - lo) // (t.shape[0] if len(t.shape) >= 2 else 1)  # a 1-D tensor is one row
        for b in sorted(sel.get(ti, {})):
            r0, r1 = t.rows[b]
            for pos in sorted(sel[ti][b]):
                data, head = heads[pos + 1]
                start = data + head[t.name]["data_offsets"][0]
                out.append((str(files[pos + 1]), start + r0 * row_bytes, (r1 - r0) * row_bytes))
    return out


@pytest.fixture
def plan(tmp_path, tiny_family):
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tiny_family], base_model="base", block_size=8 * 1024)
    p = cat.plan(PlanRequest("base", None, "ties", "50%", params={"density": 0.5}))
    return cat.execution_plan(p.plan_id)


@pytest.mark.parametrize("share", [0.3, 2.0])
def test_prefetch_reads_the_first_bytes_of_the_merge_in_order(plan, monkeypatch, share):
    reads = _expected_reads(plan)
    assert all(os.path.exists(f) for f, _, _ in reads) and len({f for f, _, _ in reads}) == 3
    total = sum(n for _, _, n in reads)
    limit = math.ceil(total * share)
    want: list[tuple[str, int, int]] = []  # the first `limit` bytes, cut where the limit falls
    left = limit
    for f, off, n in reads:
        if left > 0:
            want.append((f, off, min(n, left)))
            left -= min(n, left)
    seen = []
    sendfile = os.sendfile

    def record(out, fd, offset, count):
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), offset, count))
        return sendfile(out, fd, offset, count)

    monkeypatch.setattr(fetchplan.os, "sendfile", record)
    monkeypatch.setattr(fetchplan, "PREFETCH_CHUNK", 4096)  # several pieces per range
    p = fetchplan.Prefetch(plan, limit)
    p._thread.join()
    p.close()
    # pieces of at most a chunk, together exactly the wanted ranges (threads finish them in any order)
    assert all(n <= 4096 for _, _, n in seen)
    pieces = [(f, o, min(4096, off + n - o)) for f, off, n in want for o in range(off, off + n, 4096)]
    assert sorted(seen) == sorted(pieces)
    assert sum(n for _, _, n in seen) == min(limit, total)


def test_prefetch_keeps_a_few_reads_queued_not_all(plan, monkeypatch):
    """The prefetch queues at most 4 reads per thread at a time. It submitted every read at once
    before: a Future each, most of the executor's 96 MB traced peak at 16 experts of 2,000 small tensors."""
    queued, most = [0], [0]
    lock = threading.Lock()

    class Counting(fetchplan.ThreadPoolExecutor):
        def submit(self, fn, *args, **kwargs):
            with lock:
                queued[0] += 1
                most[0] = max(most[0], queued[0])
            f = super().submit(fn, *args, **kwargs)
            f.add_done_callback(lambda _: _done())
            return f

    def _done():
        with lock:
            queued[0] -= 1

    monkeypatch.setattr(fetchplan, "ThreadPoolExecutor", Counting)
    monkeypatch.setattr(fetchplan, "PREFETCH_CHUNK", 4096)  # many pieces
    pieces = sum(-(-n // 4096) for _, _, n in _expected_reads(plan))
    p = fetchplan.Prefetch(plan, 10**9, threads=2)
    p._thread.join()
    p.close()
    assert pieces > 100 and 0 < most[0] <= 4 * 2, (pieces, most[0])


def test_prefetch_stops_when_closed_and_ignores_inputs_it_cannot_open(plan, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(fetchplan.os, "sendfile", lambda *a: calls.append(a) or 0)
    p = fetchplan.Prefetch.__new__(fetchplan.Prefetch)  # its reading, run here, after a close
    p._stop = threading.Event()
    p._stop.set()
    p._run(plan, 10**9, 2)
    assert calls == []
    gone = Path(plan.experts[0].path) / "model.safetensors"
    gone.rename(tmp_path / "moved.safetensors")  # the merger reports it; the prefetch reads nothing
    p = fetchplan.Prefetch(plan, 10**9)
    p.close()
    assert calls == []


KERNEL_RUN = r"""
import hashlib, sys
import numpy as np
from mergedb import jitkernels as kernels  # numba's kernels, whatever the C ones; installs the light loads
rng = np.random.default_rng(7)
n = 3000
base = (rng.integers(0, 2**14, n) + 0x3000).astype(np.uint16)
ex = (base[None, :] + rng.integers(-40, 40, (3, n))).astype(np.uint16)
h = hashlib.sha256()
for mode in (0, 1, 2):
    acc = np.zeros((5, n), np.float32)
    coefs, lo, hi = np.array([1.0, 0.5, 0.25], np.float32), np.zeros(3), np.full(3, np.inf)
    keys = np.array([11, 12, 13], np.uint64)
    kernels.fold_group(base, ex, 0, mode, 5, coefs, lo, hi, keys, 0.6, 0.0, np.zeros((0, 1 << 15)), acc)
    out = np.empty(n, np.uint16)
    kernels.finish(base, 0, acc, True, 0.8, np.empty(0, np.float32), out)
    h.update(acc.tobytes() + out.tobytes())
hits = kernels.fold_group.stats.cache_hits and kernels.finish.stats.cache_hits
print(h.hexdigest(), bool(hits), "numba.np.arraymath" in sys.modules)
"""


@pytest.mark.skipif(not jitload.tested_numba(), reason="light cache loads are off on an unchecked numba")
def test_kernels_loaded_from_cache_without_numba_refresh_compute_the_same(tmp_path):
    """A fresh process loads the kernels from numba's cache without the lowering registries and
    gets the bytes that a process that compiled them (or loaded them after a full refresh) gets."""
    line = (
        "from mergedb import jitkernels as kernels  # numba's kernels, whatever the C ones; installs the light loads\n"
    )
    full = KERNEL_RUN.replace(
        line,
        line + "from numba.core.registry import cpu_target; cpu_target.target_context.refresh()\n",
    )
    ref = subprocess.run([sys.executable, "-c", full], capture_output=True, text=True, cwd=tmp_path, check=True)
    light = subprocess.run([sys.executable, "-c", KERNEL_RUN], capture_output=True, text=True, cwd=tmp_path, check=True)
    ref_hash, _, ref_registries = ref.stdout.split()
    got_hash, hits, registries = light.stdout.split()
    assert got_hash == ref_hash and ref_registries == "True"
    if hits == "True":  # numba's cache is writable here, so the second process loaded from it
        assert registries == "False", "a cached load imported numba's lowering registries"


REGISTER_RUN = r"""
import hashlib, os, sys
os.environ["MERGEDB_KERNELS"] = "numba"  # numba's kernels, whatever the C ones
from numba.core import cpu
refreshed = []
_refresh = cpu.CPUContext.refresh
cpu.CPUContext.refresh = lambda self: refreshed.append(1) or _refresh(self)
if sys.argv[2] == "full":
    from numba.core.registry import cpu_target; cpu_target.target_context.refresh()
from mergedb import deltapass
from mergedb.catalog import Catalog
cat = Catalog(sys.argv[1] + "/" + sys.argv[3] + ".duckdb")  # a new catalog: nothing skipped
cat.register([sys.argv[1] + "/fam"], base_model="base", threads=2)
with cat.duckdb_connection() as con:
    rows = [con.execute(f"SELECT * FROM {t} ORDER BY ALL").fetchall()
            for t in ("expert_blocks", "expert_tensors", "blocks")]
hits = bool(deltapass._group_pass.stats.cache_hits)
print(hashlib.sha256(repr(rows).encode()).hexdigest(), hits, len(refreshed) > (sys.argv[2] == "full"))
"""


@pytest.mark.skipif(not jitload.tested_numba(), reason="light cache loads are off on an unchecked numba")
def test_registration_kernels_loaded_without_numba_refresh_store_the_same_rows(tmp_path):
    """Registration's numba kernels (deltapass.py) load from numba's cache without the full target
    refresh too: a registration in a fresh process stores the rows a process
    that refreshed first stores, and, when its kernels came from the cache, never refreshed."""
    from mergedb.synth import make_family

    make_family(tmp_path / "fam", experts=2, size="tiny", seed=3)
    run = lambda mode, name: subprocess.run(  # noqa: E731
        [sys.executable, "-c", REGISTER_RUN, str(tmp_path), mode, name], capture_output=True, text=True, check=True
    ).stdout.split()
    ref_hash, _, _ = run("full", "a")
    run("light", "b")  # fills numba's cache if this checkout's kernels were never compiled
    got_hash, hits, refreshed = run("light", "c")
    assert got_hash == ref_hash
    if hits == "True":  # numba's cache is writable here, so the process loaded from it
        assert refreshed == "False", "a cached registration kernel refreshed numba's whole target"


def test_prefetch_reads_nothing_when_the_inputs_twice_would_not_fit_the_open_file_limit(plan, monkeypatch):
    """The prefetch opens every input file and the merger opens them again: near RLIMIT_NOFILE it
    stays out of the way rather than make the merger's opens fail."""
    import resource

    calls = []
    monkeypatch.setattr(fetchplan.os, "sendfile", lambda *a: calls.append(a) or 0)
    open_now = len(os.listdir("/proc/self/fd"))
    files = 1 + len(plan.experts)  # one model.safetensors per checkpoint in this family
    monkeypatch.setattr(resource, "getrlimit", lambda r: (open_now + 2 * files + fetchplan.FD_MARGIN - 1,) * 2)
    p = fetchplan.Prefetch(plan, 10**9)
    p._thread.join()
    p.close()
    assert calls == []
    monkeypatch.setattr(resource, "getrlimit", lambda r: (open_now + 2 * files + fetchplan.FD_MARGIN + 8,) * 2)
    p = fetchplan.Prefetch(plan, 10**9)
    p._thread.join()
    p.close()
    assert calls  # with room, it reads


def test_selected_groups_the_mask_by_tensor_and_block(plan):
    """ExecutionPlan.selected (the merger's and the prefetch's view of the mask) against the mask's
    rows grouped by hand: per tensor and block, (position, hash) in position order; "" for hashes
    when they are not wanted (only --verify reads them); only tensors 0..last when asked."""
    rows = sorted(plan.mask.to_pylist(), key=lambda r: (r["tensor_idx"], r["block_idx"], r["position"]))
    assert len({(r["tensor_idx"], r["block_idx"]) for r in rows}) < len(rows)  # blocks with several experts
    for last in [None, *range(len(plan.tensors))]:
        for hashes in (True, False):
            want: dict = {}
            for r in rows:
                if last is None or r["tensor_idx"] <= last:
                    pair = (r["position"], r["content_hash"] if hashes else "")
                    want.setdefault(r["tensor_idx"], {}).setdefault(r["block_idx"], []).append(pair)
            assert plan.selected(hashes, last) == want


def test_unreadable_numba_version_turns_light_loads_off(monkeypatch):
    import numba

    monkeypatch.setattr(numba, "__version__", "0+unknown")
    assert jitload.tested_numba() is False
    monkeypatch.setattr(numba, "__version__", "0.68.1")
    assert jitload.tested_numba() is True


def test_main_inside_another_program_leaves_its_collector_working(monkeypatch):
    import gc

    from mergedb import cli

    monkeypatch.setattr(sys, "argv", ["mergedb", "--version"])
    with pytest.raises(SystemExit):
        cli.main()
    assert gc.isenabled() and cli._PROCESS is False and gc.get_freeze_count() == 0


def test_register_holds_the_collector_until_its_scan_starts(tmp_path, tiny_family, monkeypatch):
    """`mergedb register` holds Python's collector while it imports and opens the catalog (the
    ~1M objects of numba, DuckDB and pyarrow would be scanned by every collection of the scan:
    ~0.08 CPU-s of a 4-expert registration), then freezes them and lets it run for the scan, and
    leaves it running when done."""
    import gc

    from mergedb import cli
    from mergedb.catalog import Catalog

    seen: list[bool] = []
    real = Catalog.register

    def spy(self, *a, on_total=None, **k):
        def total(n):
            seen.append(gc.isenabled())
            on_total(n)
            seen.append(gc.isenabled())

        return real(self, *a, on_total=total, **k)

    monkeypatch.setattr(Catalog, "register", spy)
    argv = ["mergedb", "register", str(tiny_family), "--base-model", "base", "--catalog", str(tmp_path / "c.duckdb")]
    monkeypatch.setattr(sys, "argv", [*argv, "--quiet"])
    try:
        with pytest.raises(SystemExit) as e:
            cli.main()
        assert e.value.code in (0, None)
        assert seen == [False, True]  # held until the scan starts, running during it
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert len(Catalog(tmp_path / "c.duckdb").checkpoints()) > 1
    finally:
        gc.unfreeze()
