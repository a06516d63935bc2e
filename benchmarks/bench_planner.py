"""Planning time and peak memory on simulated catalogs of 1M and 10M (expert, block) rows.
Run: python -m benchmarks.bench_planner [--quick]"""

from __future__ import annotations

import argparse
import time

from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest
from mergedb.synth import simulate

from .common import CACHE, peak_rss_mib, save


def run(rows_list=(1_000_000, 10_000_000), experts: int = 20) -> dict:
    out = []
    for rows in rows_list:
        db = CACHE / f"planner-{rows}.duckdb"
        if not db.exists():
            CACHE.mkdir(parents=True, exist_ok=True)
            blocks = rows // experts
            simulate(Catalog(db), experts, tensors=blocks // 1000, blocks_per_tensor=1000, seed=1)
        cat = Catalog(db)
        base = cat.checkpoints()[0].name
        for method, budget in (("task_arithmetic", "10%"), ("task_arithmetic", "50%")):
            t0 = time.perf_counter()
            p = cat.plan(PlanRequest(base, None, method, budget))
            out.append(
                {
                    "rows": p.n_candidates,
                    "method": method,
                    "budget": budget,
                    "plan_seconds": time.perf_counter() - t0,
                    "planner_reported_seconds": p.planning_seconds,
                    "selected_bytes": p.selected_bytes,
                    "budget_bytes": p.budget_bytes,
                    "peak_rss_mib": peak_rss_mib(),
                }
            )
            print(out[-1])
    return {"runs": out}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    doc = run((20_000,), 4) if a.quick else run()
    print(save("planner" + ("-quick" if a.quick else ""), doc))
