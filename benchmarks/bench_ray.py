"""The Ray executor with 1 and 2 local workers against the local executor, side by side.

On the bench family (benchmarks/cache/family-bench-20): its base and first K experts copied into a
temporary folder and registered there, so no other job reading the shared family warms the page
cache between an arm's eviction and its run. One plan, several output shards (--shard, the same
for every arm, so the outputs are byte-identical: checked by content hash). Each arm starts from a
cold page cache (every family file evicted) in a process of its own, and the arms alternate in
every repeat so they share the machine's mood (medians over the repeats are compared):
  local  `mergedb execute` (all cores: the local executor's default threads)
  ray-1  a local Ray of 1 CPU: shards one at a time, each task merging on 1 thread
  ray-2  a local Ray of 2 CPUs: two shards at a time, each on 1 thread
For a Ray arm `execute s` is the run's own time (from the lock to the install, tasks included) and
`ray start s` is ray.init's; wall is the whole process. Bytes read from storage are the tasks'
/proc/self/io read_bytes, summed by the driver into the manifest.

Run: python -m benchmarks.bench_ray [--k 8] [--method ties] [--budget all] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest

from .common import CACHE, evict, save

ARMS = ("local", "ray-1", "ray-2")
CLI = [sys.executable, "-m", "mergedb.cli"]
PARAMS = {"ties": {"density": 0.2}, "task_arithmetic": {"lambda": 0.5}, "dare_ties": {"density": 0.5}}

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import ray
from mergedb import rayexec
from mergedb.catalog import Catalog
db, plan, out, cpus, shard = sys.argv[1:6]
ray.init(address="local", num_cpus=int(cpus), include_dashboard=False, log_to_driver=False)
t_ray = time.perf_counter() - t0
Catalog(db).execute(int(plan), out, max_shard_size=int(shard), write_shards=rayexec.shard_writer(threads=1))
ray.shutdown()
print(json.dumps({"ray_start_seconds": t_ray}))
"""


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _arm(arm: str, db: Path, plan_id: int, out: Path, shard: int, files: list[Path]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    evict(files)
    t0, c0 = time.perf_counter(), _cpu()
    extra: dict = {}
    if arm == "local":
        cmd = CLI + ["execute", str(plan_id), "--out", str(out), "-c", str(db), "-q", "--max-shard-size", str(shard)]
        subprocess.run(cmd, check=True)
    else:
        cpus = arm.split("-")[1]
        p = subprocess.run(
            [sys.executable, "-c", _CHILD, str(db), str(plan_id), str(out), cpus, str(shard)],
            check=True,
            capture_output=True,
            text=True,
        )
        extra = json.loads(p.stdout.strip().splitlines()[-1])
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    doc = json.loads((out / "mergedb_manifest.json").read_text())
    run = doc["run"]
    shards = len(list(out.glob("model-*.safetensors")))
    shutil.rmtree(out)
    return {
        "arm": arm,
        "wall": wall,
        "cpu_seconds": cpu,  # the driver's and its children's; Ray's workers are the raylet's children
        "execute_seconds": run["seconds"],
        "expert_bytes": run["expert_bytes_logical"],
        "base_bytes": run["base_bytes"],
        "physical_bytes": run["physical_read_bytes"],
        "peak_rss_bytes": run["peak_rss_bytes"],
        "shards": shards,
        "content_hash": doc["content_hash"],
        **extra,
    }


def private_copy(family: Path, k: int, work: Path) -> tuple[Path, Path]:
    """The base and first `k` experts of `family` copied into `work` and registered there (4 MiB
    blocks): other jobs reading the shared family cannot warm these files' page cache between an
    arm's eviction and its run."""
    fam = work / "family"
    for name in ["base", *(f"expert_{i:02d}" for i in range(k))]:
        shutil.copytree(family / name, fam / name)
    db = work / "bench-ray.duckdb"
    Catalog(db).register([fam], base_model="base", block_size="4MiB")
    return fam, db


def run(k: int, method: str, budget: str, repeats: int, shard: int, family: Path, db: Path, work: Path) -> dict:
    experts = tuple(f"expert_{i:02d}" for i in range(k))
    plan = Catalog(db).plan(PlanRequest("base", experts, method, budget, None, PARAMS.get(method, {})))
    files = list(family.rglob("*.safetensors"))
    rows = []
    for rep in range(repeats):
        for arm in ARMS:
            rows.append({"repeat": rep, **_arm(arm, db, plan.plan_id, work / "out", shard, files)})
    hashes = {r["content_hash"] for r in rows}
    if len(hashes) != 1:
        raise SystemExit(f"the arms wrote different outputs: {sorted(hashes)}")
    best = {a: min((r for r in rows if r["arm"] == a), key=lambda r: r["execute_seconds"]) for a in ARMS}
    median = {a: statistics.median(r["execute_seconds"] for r in rows if r["arm"] == a) for a in ARMS}
    return {
        "k": k,
        "method": method,
        "budget": budget,
        "selected_bytes": plan.selected_bytes,
        "shard_bytes": shard,
        "load_average": os.getloadavg(),
        "rows": rows,
        "best": best,
        "median_execute_seconds": median,
        "ray2_over_ray1": median["ray-1"] / median["ray-2"],  # medians: single runs swing with the load
        "local_over_ray2": median["ray-2"] / median["local"],
        "outputs_identical": True,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--method", default="ties")
    ap.add_argument("--budget", default="all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard", type=int, default=50 * 10**6, help="--max-shard-size of every arm, in bytes")
    ap.add_argument("--quick", action="store_true", help="a tiny family of 4 experts made for the run")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mergedb-bench-ray-") as tmp:
        work = Path(tmp)
        if a.quick:
            family = synth.make_family(work / "family", experts=4, size="tiny", seed=0)
            catalog = work / "catalog.duckdb"
            Catalog(catalog).register([family], base_model="base", block_size="64KiB")
            k, shard = min(a.k, 4), 300_000
        else:
            if not (CACHE / "family-bench-20" / "expert_19").exists():
                raise SystemExit("benchmarks/cache/family-bench-20 is missing: python -m benchmarks.run builds it")
            k, shard = a.k, a.shard
            family, catalog = private_copy(CACHE / "family-bench-20", k, work)
        doc = run(k, a.method, a.budget, a.repeats, shard, family, catalog, work)
    print(save("ray-quick" if a.quick else "ray", doc))
    for arm, sec in doc["median_execute_seconds"].items():
        print(f"{arm}: median execute {sec:.2f}s")


if __name__ == "__main__":
    main()
