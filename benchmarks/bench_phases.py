"""Where a real `mergedb execute` process's time goes: python -m benchmarks.bench_phases TREE... [--repeats N]

Each TREE is a folder holding a `mergedb` package (`git archive REV mergedb queries schema`
unpacked; TREE:VAR=VALUE sets an environment variable for that tree's runs). For each repeat, the
trees in turn run the CLI's own entry point (`mergedb.cli.main`, so its start and exit are the
command's) on a 10% task-arithmetic plan of the bench family (K=8, 2 threads), in a fresh process on
a cold page cache, with clocks at the phase boundaries: interpreter up, CLI imported, arguments
parsed (the command's body starts), catalog opened, `Catalog.execute` returned (plan load, merge,
run record), `main` done (its atexit handlers run); the parent measures spawn to exit. `fixed` = process wall − the
executor's own seconds (issue 11); `exit` = the interpreter's teardown. The first round fills
numba's caches and is dropped. Prints a table, saves results/start-phases.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest

from .common import CACHE, compiled, evict, save

DRIVER = r"""
import json, sys, time
T0 = float(sys.argv[1]); T = {"interp": time.time() - T0}; P0 = time.perf_counter()
def mark(k): T[k] = time.perf_counter() - P0 + T["interp"]; T["cpu_" + k] = time.process_time()
import mergedb.cli as cli
mark("import_cli")
orig = cli._catalog
def _catalog(*a, **k):
    mark("cli_body"); cat = orig(*a, **k); mark("catalog_open")
    import mergedb.catalog as catmod
    execute = catmod.Catalog.execute
    def timed(self, *a, **k):
        r = execute(self, *a, **k); mark("catalog_execute_done"); T["executor_seconds"] = r.seconds; return r
    catmod.Catalog.execute = timed
    return cat
cli._catalog = _catalog
sys.argv = ["mergedb", *sys.argv[2:]]
import atexit
# at exit, not after main(): an execute process may end inside main (os._exit after the atexit handlers)
atexit.register(lambda: (mark("main_done"), print("PHASES", json.dumps(T), flush=True)))
try:
    cli.entry()  # the console script's entry: its own process
except SystemExit as e:
    assert not e.code, e.code
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--save", default="start-phases")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mergedb-phases-"))
    catalog = work / "catalog.duckdb"
    shutil.copyfile(CACHE / "catalog-bench-20-4MiB.duckdb", catalog)
    experts = tuple(f"expert_{i:02d}" for i in range(8))
    plan = Catalog(catalog).plan(PlanRequest("base", experts, "task_arithmetic", "10%", params={"lambda": 0.5}))
    fam = CACHE / "family-bench-20"
    files = sorted(p for d in ("base", *experts) for p in (fam / d).glob("*.safetensors"))
    rows: dict[str, list[dict]] = {t: [] for t in a.trees}
    for rep in range(a.repeats + 1):
        for spec in a.trees:
            tree, *env = spec.split(":")
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            evict(files)
            compiled(Path(tree).resolve())
            t = time.time()
            args = ["execute", str(plan.plan_id), "--out", str(out), "-c", str(catalog), "-q", "--threads", "2"]
            p = subprocess.run(
                [sys.executable, "-c", DRIVER, str(t), *args],
                env={**os.environ, "PYTHONPATH": str(Path(tree).resolve()), **dict(kv.split("=", 1) for kv in env)},
                cwd=work,  # not the checkout: `-c` puts the working directory first on sys.path
                capture_output=True,
                text=True,
            )
            wall = time.time() - t
            if p.returncode:
                raise SystemExit(p.stderr)
            r = json.loads(p.stdout.split("PHASES", 1)[1])
            r.update(process_wall=wall, exit=wall - r["main_done"], fixed=wall - r["executor_seconds"])
            if rep:
                rows[spec].append(r)
    shutil.rmtree(work, ignore_errors=True)
    for spec, rs in rows.items():
        print(spec)
        for k in (k for k in rs[0] if not k.startswith("cpu_")):
            print(f"  {k:24}", " ".join(f"{r[k]:.3f}" for r in rs))
    print(save(a.save, {"plan": "task_arithmetic 10% K=8, 2 threads", "runs": rows}))


if __name__ == "__main__":
    main()
