"""Planning time and peak memory on simulated catalogs of 1M, 10M and 35M (expert, block) rows.

35M is issue 15's family: 1,000 experts × a 70B layout at 4 MiB blocks (~35,000 blocks each; here
700 tensors × 50 blocks, sketches of dimension 8 so that the catalog fits a small disk: a plan
reads no sketch above 2M omitted blocks). Each plan runs in a fresh process, so its peak RSS
(VmHWM) is its own; CPU seconds are reported beside wall seconds because the machine may be
shared (the load average at the start of each run is recorded).
Run: python -m benchmarks.bench_planner [--quick] [--catalog-dir DIR] [--rows 1000000 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from .common import CACHE, save

SHAPES = {  # rows -> (experts, tensors, blocks per tensor, sketch dim)
    20_000: (4, 5, 1000, None),
    1_000_000: (20, 50, 1000, None),
    10_000_000: (20, 500, 1000, None),
    35_000_000: (1000, 700, 50, 8),
}
BUDGETS = {20_000: ("10%", "50%"), 1_000_000: ("10%", "50%"), 10_000_000: ("10%", "50%"), 35_000_000: ("10%",)}


def catalog(rows: int, folder: Path) -> Path:
    """The simulated catalog of `rows` candidates in `folder` (made once, then reused)."""
    from mergedb.catalog import Catalog
    from mergedb.synth import simulate

    db = folder / f"planner-{rows}.duckdb"
    if not db.exists():
        folder.mkdir(parents=True, exist_ok=True)
        experts, tensors, blocks, dim = SHAPES[rows]
        simulate(Catalog(db, sketch_dim=dim), experts, tensors=tensors, blocks_per_tensor=blocks, seed=1)
    return db


def one(db: Path, budget: str) -> dict:
    """Plan task arithmetic over every expert at `budget` in this process; time, CPU and memory."""
    from mergedb.catalog import Catalog
    from mergedb.planner import PlanRequest

    cat = Catalog(db)
    base = cat.checkpoints()[0].name
    load = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    p = cat.plan(PlanRequest(base, None, "task_arithmetic", budget))
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    hwm = next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
    return {
        "rows": p.n_candidates,
        "experts": len(p.experts),
        "method": "task_arithmetic",
        "budget": budget,
        "plan_seconds": wall,
        "planner_reported_seconds": p.planning_seconds,
        "cpu_seconds": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "selected_bytes": p.selected_bytes,
        "budget_bytes": p.budget_bytes,
        "n_selected": p.n_selected,
        "peak_rss_mib": hwm / 1024,
        "load_average_1min": load,
    }


def run(rows_list=(1_000_000, 10_000_000, 35_000_000), folder: Path = CACHE) -> dict:
    out = []
    for rows in rows_list:
        db = catalog(rows, folder)
        for budget in BUDGETS[rows]:
            res = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_planner", "--one", str(db), budget],
                capture_output=True,
                text=True,
                check=True,
            )
            # the child's stdout may hold DuckDB's progress bar: the result is the line marked RESULT
            out.append(json.loads(res.stdout.rsplit("RESULT ", 1)[1].splitlines()[0]))
            print(out[-1], flush=True)
    return {"runs": out}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--catalog-dir", type=Path, default=CACHE)
    ap.add_argument("--rows", type=int, nargs="*", choices=sorted(SHAPES))
    ap.add_argument("--one", nargs=2, metavar=("CATALOG", "BUDGET"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(Path(a.one[0]), a.one[1])))
    else:
        rows = tuple(a.rows) if a.rows else ((20_000,) if a.quick else (1_000_000, 10_000_000, 35_000_000))
        doc = run(rows, a.catalog_dir)
        print(save("planner" + ("-quick" if a.quick else ""), doc))
