"""Register throughput as a fraction of a plain cold sequential read of the same files, and
catalog size as a fraction of checkpoint bytes.
Run: python -m benchmarks.bench_register [--quick] [--size small] [--experts 4] [--threads 1,2]
(--threads: one register run per count, side by side in each repeat; default: the machine's cores)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

from mergedb import synth
from mergedb.catalog import Catalog

from .common import CACHE, evict, read_bytes, save, sequential_read


def run(size: str = "bench", experts: int = 4, repeats: int = 3, threads: tuple[int, ...] | None = None) -> dict:
    threads = threads or (os.cpu_count() or 1,)
    fam = CACHE / f"register-{size}-{experts}"
    if not (fam / f"expert_{experts - 1:02d}").exists():
        shutil.rmtree(fam, ignore_errors=True)
        synth.make_family(fam, experts=experts, size=size, seed=0)
    files = sorted(fam.rglob("*.safetensors"))
    rows = []
    for _ in range(repeats):
        n_seq, t_seq = sequential_read(files)
        for n_threads in threads:
            db = CACHE / "register.duckdb"
            for p in CACHE.glob("register.duckdb*"):
                p.unlink()
            evict(files)
            r0, t0 = read_bytes(), time.perf_counter()
            res = Catalog(db).register([fam], base_model="base", threads=n_threads)
            t_reg = time.perf_counter() - t0
            physical = read_bytes() - r0
            rows.append(
                {
                    "threads": n_threads,
                    "sequential_gbps": n_seq / t_seq / 1e9,
                    "register_gbps": n_seq / t_reg / 1e9,  # the same files' bytes over register's wall time
                    "ratio": (n_seq / t_reg) / (n_seq / t_seq),
                    "register_seconds": t_reg,
                    "logical_bytes": res.bytes_read,
                    "physical_bytes": physical,
                    "file_bytes": n_seq,
                    "catalog_bytes": db.stat().st_size,
                    "catalog_fraction": db.stat().st_size / n_seq,
                }
            )
    mine = [r for r in rows if r["threads"] == threads[-1]]  # the headline: the last (default: all cores)
    by_threads = {n: statistics.median(r["ratio"] for r in rows if r["threads"] == n) for n in threads}
    return {
        "size": size,
        "experts": experts,
        "threads": list(threads),
        "runs": rows,
        "best_ratio": max(r["ratio"] for r in mine),
        "median_ratio": statistics.median(r["ratio"] for r in mine),
        "median_ratio_by_threads": by_threads,
        "catalog_fraction": rows[-1]["catalog_fraction"],
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default=None, help="comma-separated thread counts, e.g. 1,2")
    a = ap.parse_args()
    counts = tuple(int(x) for x in a.threads.split(",")) if a.threads else None
    doc = run("tiny", 2, 1, counts) if a.quick else run(a.size, a.experts, a.repeats, counts)
    print(save("register" + ("-quick" if a.quick else ""), doc))
    print({k: v for k, v in doc.items() if k != "runs"})
