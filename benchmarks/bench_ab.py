"""Side-by-side executor runs of two mergedb source trees: python -m benchmarks.bench_ab BEFORE AFTER

Each tree is a folder holding a `mergedb` package (e.g. `git archive HEAD~3 mergedb queries schema`
unpacked somewhere). Plans are made once, by the tree this module is imported from, in a private
copy of the bench catalog; then every (method, threads) runs `mergedb execute` from each tree in
turn (which one first alternates with the repeat), in a fresh process on a cold page cache, and
the cold sequential-read rate of the same expert files is measured in the same run. Prints one
JSON document: per run the process wall time, the executor's own seconds (from the manifest) and the fixed cost (the
difference), and the ratios after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest

from .common import CACHE, compiled, evict, sequential_read
from .run import METHOD_PARAMS


def run_once(tree: Path, catalog: Path, plan_id: int, out: Path, threads: int, files: list[Path]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    evict(files)
    compiled(tree)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "mergedb.cli", "execute", str(plan_id), "--out", str(out), "-c", str(catalog), "-q"]
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(
        [*cmd, "--threads", str(threads)], check=True, env=env, cwd=out.parent
    )  # not cwd: `-m` puts it first
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    doc = json.loads((out / "mergedb_manifest.json").read_text())
    return {
        "wall": wall,
        "execute": doc["run"]["seconds"],
        "fixed": wall - doc["run"]["seconds"],
        # CPU seconds of the process (user + system): far less sensitive than wall time to other
        # work on a shared machine
        "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
        "read_bytes": doc["run"]["expert_bytes_logical"] + doc["run"]["base_bytes"],
        "hash": doc["content_hash"],
        "rng": doc.get("rng"),  # shows which tree ran (DARE/DELLA)
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--methods", default="task_arithmetic,ties,dare_ties,dare_linear,della,della_linear,model_stock")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--budget", default="all")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--catalog", default="catalog-bench-20-4MiB.duckdb", help="a bench-family catalog in the cache")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mergedb-ab-"))
    catalog = work / "catalog.duckdb"
    shutil.copyfile(CACHE / a.catalog, catalog)
    fam = CACHE / "family-bench-20"
    experts = tuple(f"expert_{i:02d}" for i in range(a.k))
    files = sorted(p for d in ("base", *experts) for p in (fam / d).glob("*.safetensors"))
    cat = Catalog(catalog)
    plans = {
        m: cat.plan(PlanRequest("base", experts, m, a.budget, params=METHOD_PARAMS[m])).plan_id
        for m in a.methods.split(",")
    }
    del cat
    trees = {"before": a.before.resolve(), "after": a.after.resolve()}
    warm = [plans[m] for m in ("task_arithmetic", "della", "model_stock") if m in plans]
    for tree in trees.values():  # numba's caches filled (the per-step path's kernels too) before anything is timed
        for pid in warm:
            run_once(tree, catalog, pid, work / "out", 2, [])
    n, secs = sequential_read([p for p in files if "base" not in str(p)])
    rows = []
    for method, pid in plans.items():
        for threads in (int(t) for t in a.threads.split(",")):
            for rep in range(a.repeats):
                # which tree runs first alternates with the repeat: the second of two back-to-back processes
                # runs slower here (bench_register's note), which always handicapped "after" before
                order = list(trees.items()) if rep % 2 == 0 else list(reversed(trees.items()))
                got = {name: run_once(tree, catalog, pid, work / "out", threads, files) for name, tree in order}
                row = {"method": method, "threads": threads, "repeat": rep, **{k: v for k, v in got.items()}}
                row["execute_ratio"] = got["after"]["execute"] / got["before"]["execute"]
                row["wall_ratio"] = got["after"]["wall"] / got["before"]["wall"]
                row["cpu_ratio"] = got["after"]["cpu"] / got["before"]["cpu"]
                row["share_of_disk_after"] = got["after"]["read_bytes"] / got["after"]["wall"] / (n / secs)
                rows.append(row)
                print(
                    f"{method:16} t={threads} before {got['before']['wall']:6.2f}s "
                    f"(exec {got['before']['execute']:6.2f}) after {got['after']['wall']:6.2f}s "
                    f"(exec {got['after']['execute']:6.2f})  "
                    f"exec ×{row['execute_ratio']:.2f} cpu {got['before']['cpu']:.1f}s -> {got['after']['cpu']:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
    n2, secs2 = sequential_read([p for p in files if "base" not in str(p)])
    print(json.dumps({"sequential_gbps": [n / secs / 1e9, n2 / secs2 / 1e9], "rows": rows}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
