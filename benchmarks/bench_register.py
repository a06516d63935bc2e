"""Register throughput as a fraction of a plain cold sequential read of the same files, and
catalog size as a fraction of checkpoint bytes.
Run: python -m benchmarks.bench_register [--quick] [--size small] [--experts 4] [--threads 1,2]
     [--baseline SRC]
(--threads: one register run per count, side by side in each repeat; default: the machine's cores.
--baseline: another mergedb source tree, e.g. `git archive REV | tar -x -C SRC`, registered side by
side with this one in every repeat (after one untimed registration each, which fills their numba
caches; the two alternate which goes first), so before/after ratios share the disk's mood; the two catalogs
are then compared table by table, every row except paths and times, and the run fails if any
differs: a faster registration must store the same catalog.)
Every registration is a fresh process (imports and numba's cache load included in its wall time,
process start not), on a cold page cache, into a new catalog in a temporary folder; its CPU
seconds (all threads) are recorded too, a measure a busy machine disturbs less than wall time."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mergedb import synth

from .common import CACHE, compiled, evict, save, sequential_read

_CHILD = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
t0, c0 = time.perf_counter(), os.times()
from mergedb.catalog import Catalog
from mergedb.executor import physical_read_bytes
r0 = physical_read_bytes()
res = Catalog(sys.argv[3]).register([sys.argv[2]], base_model="base", threads=int(sys.argv[4]))
c1 = os.times()
print(json.dumps({"seconds": time.perf_counter() - t0, "logical_bytes": res.bytes_read,
                  "cpu_seconds": (c1.user - c0.user) + (c1.system - c0.system),
                  "physical_bytes": physical_read_bytes() - r0}))
"""


def _register(src: Path, fam: Path, db: Path, threads: int) -> dict:
    """One registration in a fresh process running the mergedb found in `src`."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(fam), str(db), str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# columns that name where or when, not what: left out of the catalog comparison
_UNCOMPARED = {"path", "root", "mtime_ns", "applied_at", "registered_at", "created", "created_at"}


def catalog_rows(db: Path) -> dict[str, list[tuple]]:
    """Every table's rows (sorted; columns in _UNCOMPARED left out), read from a closed catalog."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        out = {}
        tables = "SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE' ORDER BY 1"
        for (t,) in con.execute(tables).fetchall():
            cols = con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ? ORDER BY ordinal_position", [t]
            ).fetchall()
            keep = ", ".join(f'"{c}"' for (c,) in cols if c not in _UNCOMPARED)
            out[t] = con.execute(f'SELECT {keep} FROM "{t}" ORDER BY ALL').fetchall()
        return out
    finally:
        con.close()


def _differing(a: dict[str, list[tuple]], b: dict[str, list[tuple]]) -> list[str]:
    """Tables whose rows differ (NaN equal to NaN, floats compared bit for bit via repr)."""
    return sorted(t for t in a.keys() | b.keys() if repr(a.get(t)) != repr(b.get(t)))


def run(
    size: str = "bench",
    experts: int = 4,
    repeats: int = 3,
    threads: tuple[int, ...] | None = None,
    baseline: Path | None = None,
) -> dict:
    threads = threads or (os.cpu_count() or 1,)
    fam = CACHE / f"register-{size}-{experts}"
    if not (fam / f"expert_{experts - 1:02d}").exists():
        shutil.rmtree(fam, ignore_errors=True)
        synth.make_family(fam, experts=experts, size=size, seed=0)
    files = sorted(fam.rglob("*.safetensors"))
    here = Path(__file__).resolve().parents[1]
    variants = [("current", here)] + ([("baseline", Path(baseline).resolve())] if baseline else [])
    rows = []
    compared: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mergedb-bench-register-") as tmp:
        if baseline:  # each tree's numba cache filled before anything is timed (a new tree compiles)
            for variant, src in variants:
                _register(src, fam, Path(tmp) / f"warm-{variant}.duckdb", threads[-1])
        for rep in range(repeats):
            n_seq, t_seq = sequential_read(files)
            for n_threads in threads:
                # the trees alternate which goes first: a second process back to back runs slower
                for variant, src in variants if rep % 2 == 0 else variants[::-1]:
                    db = Path(tmp) / f"{variant}-{n_threads}.duckdb"
                    for p in Path(tmp).glob(db.name + "*"):
                        p.unlink()
                    compiled(Path(src))
                    evict(files)
                    r = _register(src, fam, db, n_threads)
                    rows.append(
                        {
                            "variant": variant,
                            "threads": n_threads,
                            "sequential_gbps": n_seq / t_seq / 1e9,
                            "register_gbps": n_seq / r["seconds"] / 1e9,  # the files' bytes over register's wall
                            "ratio": t_seq / r["seconds"],
                            "register_seconds": r["seconds"],
                            "cpu_seconds": r["cpu_seconds"],  # all its threads: robust to a busy machine
                            "logical_bytes": r["logical_bytes"],
                            "physical_bytes": r["physical_bytes"],
                            "file_bytes": n_seq,
                            "catalog_bytes": db.stat().st_size,
                            "catalog_fraction": db.stat().st_size / n_seq,
                        }
                    )
                if baseline:
                    dbs = [Path(tmp) / f"{variant}-{n_threads}.duckdb" for variant, _ in variants]
                    differ = _differing(catalog_rows(dbs[0]), catalog_rows(dbs[1]))
                    if differ:
                        raise SystemExit(f"the catalogs differ from the baseline's in {', '.join(differ)}")
                    compared.append(f"{n_threads} threads")
    cur = [r for r in rows if r["variant"] == "current"]
    mine = [r for r in cur if r["threads"] == threads[-1]]  # the headline: the last (default: all cores)

    def by_threads(variant: str) -> dict[int, float]:
        return {
            n: statistics.median(r["ratio"] for r in rows if r["threads"] == n and r["variant"] == variant)
            for n in threads
        }

    doc = {
        "size": size,
        "experts": experts,
        "threads": list(threads),
        "runs": rows,
        "best_ratio": max(r["ratio"] for r in mine),
        "median_ratio": statistics.median(r["ratio"] for r in mine),
        "median_ratio_by_threads": by_threads("current"),
        "catalog_fraction": cur[-1]["catalog_fraction"],
    }
    if baseline:
        doc["baseline"] = str(baseline)
        doc["catalogs_identical"] = compared  # every repeat's pair, all tables (see catalog_rows)
        doc["baseline_median_ratio_by_threads"] = by_threads("baseline")
        doc["median_cpu_seconds"] = {
            v: statistics.median(r["cpu_seconds"] for r in rows if r["variant"] == v) for v in ("current", "baseline")
        }
    return doc


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default=None, help="comma-separated thread counts, e.g. 1,2")
    ap.add_argument("--baseline", default=None, help="another mergedb source tree to run side by side")
    a = ap.parse_args()
    counts = tuple(int(x) for x in a.threads.split(",")) if a.threads else None
    base_src = Path(a.baseline) if a.baseline else None
    if a.quick:
        doc = run("tiny", 2, 1, counts, base_src)
    else:
        doc = run(a.size, a.experts, a.repeats, counts, base_src)
    print(save("register" + ("-quick" if a.quick else ""), doc))
    print({k: v for k, v in doc.items() if k != "runs"})
