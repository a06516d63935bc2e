"""Where an `execute` process's fixed time goes: python -m benchmarks.bench_start BEFORE AFTER

Runs, for each source tree in turn (PYTHONPATH=tree, fresh processes, cold page cache for the
weights), a driver that performs `mergedb execute`'s steps with a clock between them: interpreter
start, imports (CLI, catalog, executor), catalog open and plan load, numba cache load (the first
kernel calls), the merge itself (the executor's own seconds), and what follows it (output
install and manifest are inside execute; the process exit after). Also times the real CLI process
(`mergedb execute … -q`) and reports process wall − executor seconds, the fixed cost of issue 11.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import CACHE, compiled, evict

DRIVER = r"""
import json, sys, time
started = time.time() - float(sys.argv[5])  # process start (fork + exec + interpreter) until here
c0, t0 = time.process_time(), time.perf_counter()
import mergedb.cli  # noqa: F401
c1, t1 = time.process_time(), time.perf_counter()
from mergedb.catalog import Catalog
c2, t2 = time.process_time(), time.perf_counter()
from mergedb import executor
c3, t3 = time.process_time(), time.perf_counter()
cat = Catalog(sys.argv[1])
xp = cat.execution_plan(int(sys.argv[2]))
c4, t4 = time.process_time(), time.perf_counter()
import numpy as np
from mergedb import kernels
base = np.zeros(8, np.uint16); ex = np.zeros((1, 8), np.uint16); acc = np.zeros((5, 8), np.float32)
one = np.ones(1, np.float32); z = np.zeros(1)
args = (base, ex, 0, 1, 0, one, z, z, np.zeros(1, np.uint64), 1.0)
extra = (0.0, kernels.NO_RANKS) if hasattr(kernels, "NO_RANKS") else ()
kernels.fold_group(*args, *extra, acc)
kernels.finish(base, 0, acc, True, 1.0, np.empty(0, np.float32), np.empty(8, np.uint16))
c5, t5 = time.process_time(), time.perf_counter()
res = executor.execute(xp, sys.argv[3], threads=int(sys.argv[4]))
c6, t6 = time.process_time(), time.perf_counter()
print(json.dumps({"import_cli": t1 - t0, "import_catalog": t2 - t1, "import_executor": t3 - t2,
  "catalog_and_plan": t4 - t3, "numba_load": t5 - t4, "execute_call": t6 - t5, "executor_seconds": res.seconds,
  "execute_outside_merge": t6 - t5 - res.seconds, "spawn_to_first_line": started,
  "cpu_import_cli": c1 - c0, "cpu_import_catalog": c2 - c1, "cpu_import_executor": c3 - c2,
  "cpu_catalog_and_plan": c4 - c3, "cpu_numba_load": c5 - c4, "cpu_execute_call": c6 - c5, "cpu_to_t0": c0}))
"""


def main() -> None:
    trees = [Path(p).resolve() for p in sys.argv[1:3]]
    budget = sys.argv[3] if len(sys.argv) > 3 else "10%"
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    from mergedb.catalog import Catalog
    from mergedb.planner import PlanRequest

    work = Path(tempfile.mkdtemp(prefix="mergedb-start-"))
    catalog = work / "catalog.duckdb"
    shutil.copyfile(CACHE / "catalog-bench-20-auto.duckdb", catalog)
    experts = tuple(f"expert_{i:02d}" for i in range(8))
    fam = CACHE / "family-bench-20"
    files = sorted(p for d in ("base", *experts) for p in (fam / d).glob("*.safetensors"))
    cat = Catalog(catalog)
    pid = cat.plan(PlanRequest("base", experts, "task_arithmetic", budget, params={"lambda": 0.5})).plan_id
    del cat
    rows: dict[str, list[dict]] = {str(t): [] for t in trees}
    for rep in range(repeats + 1):  # the first round fills numba's caches and is dropped
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            compiled(tree)
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            evict(files)
            t = time.time()
            p = subprocess.run(
                [sys.executable, "-c", DRIVER, str(catalog), str(pid), str(out), "2", str(t)],
                env=env,
                cwd=work,  # not the checkout: `python -m`/`-c` put the working directory first on sys.path
                check=True,
                capture_output=True,
                text=True,
            )
            row = json.loads(p.stdout)
            row["driver_wall"] = time.time() - t
            shutil.rmtree(out, ignore_errors=True)
            evict(files)
            t = time.perf_counter()
            cmd = [sys.executable, "-m", "mergedb.cli", "execute", str(pid), "--out", str(out), "-c", str(catalog)]
            subprocess.run([*cmd, "-q", "--threads", "2"], env=env, check=True, cwd=work)
            row["cli_wall"] = time.perf_counter() - t
            row["cli_executor_seconds"] = json.loads((out / "mergedb_manifest.json").read_text())["run"]["seconds"]
            row["cli_fixed"] = row["cli_wall"] - row["cli_executor_seconds"]
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            row["bare_interpreter"] = time.perf_counter() - t
            if rep:
                rows[str(tree)].append(row)
    med = {tree: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]} for tree, rs in rows.items()}
    print(json.dumps({"budget": budget, "median": med, "runs": rows}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
