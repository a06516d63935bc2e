"""Register throughput as a fraction of a plain cold sequential read of the same files, and
catalog size as a fraction of checkpoint bytes. Run: python -m benchmarks.bench_register [--quick]"""

from __future__ import annotations

import argparse
import shutil
import time

from mergedb import synth
from mergedb.catalog import Catalog

from .common import CACHE, evict, read_bytes, save, sequential_read


def run(size: str = "bench", experts: int = 4, repeats: int = 3) -> dict:
    fam = CACHE / f"register-{size}-{experts}"
    if not (fam / f"expert_{experts - 1:02d}").exists():
        shutil.rmtree(fam, ignore_errors=True)
        synth.make_family(fam, experts=experts, size=size, seed=0)
    files = sorted(fam.rglob("*.safetensors"))
    rows = []
    for _ in range(repeats):
        n_seq, t_seq = sequential_read(files)
        db = CACHE / "register.duckdb"
        for p in CACHE.glob("register.duckdb*"):
            p.unlink()
        evict(files)
        r0, t0 = read_bytes(), time.perf_counter()
        res = Catalog(db).register([fam], base_model="base")
        t_reg = time.perf_counter() - t0
        physical = read_bytes() - r0
        rows.append(
            {
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
    best = max(rows, key=lambda r: r["ratio"])
    return {
        "size": size,
        "experts": experts,
        "runs": rows,
        "best_ratio": best["ratio"],
        "median_ratio": sorted(r["ratio"] for r in rows)[len(rows) // 2],
        "catalog_fraction": rows[-1]["catalog_fraction"],
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    doc = run("tiny", 2, 1) if a.quick else run()
    print(save("register" + ("-quick" if a.quick else ""), doc))
    print({k: v for k, v in doc.items() if k != "runs"})
