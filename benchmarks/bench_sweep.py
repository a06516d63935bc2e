"""One sweep of N TIES merges against N separate `mergedb execute` runs, and against one run alone.

On the bench family (benchmarks/cache/family-bench-20, K experts of it), with a copy of its catalog
(the shared catalog is never written). Each arm starts from a cold page cache (every family file
evicted) and runs in processes of its own: wall time, expert bytes asked for (logical), bytes
fetched from storage (/proc read_bytes), peak RSS (VmHWM). The N separate runs go back to back, as
a person would run them, so after the first they find the family in the page cache when it fits in
memory. Outputs go to a temporary folder, removed after each arm; each sweep output's content hash
is checked against the separate run of the same plan.

Run: python -m benchmarks.bench_sweep [--n 8] [--k 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mergedb import grid, synth
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest

from .common import CACHE, evict, save

CLI = [sys.executable, "-m", "mergedb.cli"]


def _grid(n: int) -> dict[str, list[float]]:
    """n TIES points: densities 0.1, 0.2, ... against λ ∈ {0.5, 1.0}."""
    return {"density": [round(0.05 + 0.9 * (i + 0.5) / (n // 2), 3) for i in range(n // 2)], "lambda": [0.5, 1.0]}


def _run_record(out: Path) -> dict:
    m = json.loads((out / "mergedb_manifest.json").read_text())
    r = m["run"]
    return {
        "seconds": r["seconds"],
        "expert_bytes": r["expert_bytes_logical"],
        "physical_bytes": r["physical_read_bytes"],
        "peak_rss_bytes": r["peak_rss_bytes"],
        "content_hash": m["content_hash"],
    }


def _cpu() -> float:
    """CPU seconds (user + system) of every finished child process so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _execute(db: Path, plan_id: int, out: Path) -> dict:
    t0, c0 = time.perf_counter(), _cpu()
    subprocess.run(CLI + ["execute", str(plan_id), "--out", str(out), "-c", str(db), "-q"], check=True)
    return {"wall": time.perf_counter() - t0, "cpu_seconds": _cpu() - c0, **_run_record(out)}


def run(n: int, k: int, family: Path, catalog: Path, work: Path) -> dict:
    db = work / "bench-sweep.duckdb"
    shutil.copyfile(catalog, db)
    cat = Catalog(db)
    experts = tuple(f"expert_{i:02d}" for i in range(k))
    reqs = grid.grid_requests(PlanRequest("base", experts, "ties", "all"), _grid(n), f"bench-{n}x{k}")
    plans = grid.plan_all(cat, reqs)
    files = list(family.rglob("*.safetensors"))
    doc: dict = {"n": n, "k": k, "plans": [p.name for p in plans], "selected_bytes": plans[0].selected_bytes}

    evict(files)
    doc["one"] = _execute(db, plans[0].plan_id, work / "one")
    shutil.rmtree(work / "one")

    evict(files)
    t0, c0 = time.perf_counter(), _cpu()
    ids = [str(p.plan_id) for p in plans]
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_sweep", "--child", str(db), str(work / "sweep"), *ids],
        check=True,
        capture_output=True,
        text=True,
    )
    doc["sweep"] = {
        "wall": time.perf_counter() - t0,
        "cpu_seconds": _cpu() - c0,
        **json.loads(child.stdout.splitlines()[-1]),
    }
    hashes = {p.name: _run_record(work / "sweep" / p.name)["content_hash"] for p in plans}
    shutil.rmtree(work / "sweep")

    evict(files)
    runs = []
    for p in plans:
        runs.append(_execute(db, p.plan_id, work / "separate" / p.name))
        if runs[-1]["content_hash"] != hashes[p.name]:
            raise SystemExit(f"sweep output of {p.name} differs from its separate run")
        shutil.rmtree(work / "separate" / p.name)
    doc["separate"] = {
        "wall": sum(r["wall"] for r in runs),
        "cpu_seconds": sum(r["cpu_seconds"] for r in runs),
        "expert_bytes": sum(r["expert_bytes"] for r in runs),
        "physical_bytes": sum(r["physical_bytes"] for r in runs),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "runs": runs,
    }
    doc["sweep_over_one"] = doc["sweep"]["wall"] / doc["one"]["wall"]
    doc["separate_over_sweep"] = doc["separate"]["wall"] / doc["sweep"]["wall"]
    doc["outputs_identical"] = True
    return doc


def _child(db: str, out: str, ids: list[str]) -> None:
    """The sweep arm, in its own process: prints the SweepResult's totals as one JSON line."""
    from mergedb import sweep

    res = sweep.sweep(Catalog(db), [int(i) for i in ids], out, max_parallel=len(ids))
    print(
        json.dumps(
            {
                "seconds": res.seconds,
                "expert_bytes_read": res.expert_bytes_read,
                "expert_bytes_served": res.expert_bytes_served,
                "reread_bytes": res.reread_bytes,
                "physical_bytes": res.physical_read_bytes,
                "peak_rss_bytes": res.peak_rss,
                "peak_shared_bytes": res.peak_shared_bytes,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="a tiny family of 4 experts made for the run")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child[0], a.child[1], a.child[2:])
        return
    family, catalog = CACHE / "family-bench-20", CACHE / "catalog-bench-20-4MiB.duckdb"
    if not a.quick and not catalog.exists():
        raise SystemExit(f"no {catalog}: run `python -m benchmarks.run` first")
    with tempfile.TemporaryDirectory(prefix="mergedb-bench-sweep-") as work:
        if a.quick:
            family, catalog = synth.make_family(Path(work) / "fam", experts=4, size="tiny"), Path(work) / "src.duckdb"
            Catalog(catalog).register([family], base_model="base")
        doc = run(a.n, min(a.k, 4) if a.quick else a.k, family, catalog, Path(work))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("plans",)}, indent=1, default=str))
    print(save("sweep" + ("-quick" if a.quick else ""), doc))


if __name__ == "__main__":
    main()
