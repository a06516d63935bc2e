"""The first plan of a process, old vs new code: python -m benchmarks.bench_first_plan BASELINE [--rounds N]

What `mergedb plan` pays (a CLI process makes one plan): for each round, for task arithmetic and
TIES (the bench family, K = 8, full read), a fresh process per side (BASELINE: a folder holding an
older `mergedb` package; new: this checkout), alternating which side goes first, each on its own
copy of the cached catalog, imports done before the clock starts (bench_planner --first-one). Per
plan: planning_seconds (the planner's own wall clock), make_plan's CPU seconds (all threads; less
sensitive to a busy machine) and the whole Catalog.plan call. Plan hashes must agree. Saves
results/<--save>.json with medians and ranges.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from .bench_planner import SMALL, _child
from .common import CACHE, save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", type=Path)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--catalog", type=Path, default=CACHE / "catalog-bench-20-4MiB.duckdb")
    ap.add_argument("--save", default="first-plan")
    a = ap.parse_args()
    sides = [("baseline", a.baseline.resolve()), ("new", None)]
    runs: dict[str, dict[str, list[dict]]] = {label: {m: [] for m in SMALL} for label, _ in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for method in SMALL:
                for label, code in sides if i % 2 == 0 else sides[::-1]:
                    db = Path(tmp) / f"{label}-{method}-{i}.duckdb"
                    shutil.copy(a.catalog, db)
                    runs[label][method].append(_child(["--first-one", str(db), method], code))
                    db.unlink()
    summary = {}
    for method in SMALL:
        hashes = {r["plan_hash"] for label, _ in sides for r in runs[label][method]}
        if len(hashes) != 1:
            raise SystemExit(f"{method}: plan hashes differ between baseline and new code: {sorted(hashes)}")
        for label, _ in sides:
            rs = runs[label][method]
            for key in ("planning_seconds", "planning_cpu", "call_seconds"):
                v = [r[key] for r in rs]
                summary[f"{label}/{method}/{key}"] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    for k, v in summary.items():
        print(f"{k:45} median {v['median'] * 1e3:6.2f} ms  range {v['min'] * 1e3:6.2f}-{v['max'] * 1e3:6.2f}")
    doc = {"baseline": str(a.baseline), "rounds": a.rounds, "runs": runs, "summary": summary}
    print(save(a.save, {**doc, "load_average_1min": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
