"""Families of many small tensors, old vs new code: python -m benchmarks.bench_many_tensors [BASELINE]

What a family of thousands of tiny tensors costs (an MoE's experts and norms, in the extreme): the
per-(expert, tensor) work of registration and of a merge, which the bench family's 67 large tensors
hide. A base and K experts of N float32 tensors of 4 × 16 (`synth.many_tensors`, every
tensor changed), made once under benchmarks/cache. Per round, alternating which side goes first, a
fresh process per side (BASELINE: a folder holding an older `mergedb` package; new: this checkout):
registering the K experts (the base registered first, not timed), then a full-read merge of them
for each method (cold: the family evicted first), each step a process of its own. Saves
results/<--save>.json with every run, the medians and each run's peak RSS; the merges' outputs must
be the same bytes on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import CACHE, evict, save

ROOT = Path(__file__).parent.parent
METHODS = {"task_arithmetic": {"lambda": 0.5}, "ties": {"density": 0.2}}


def _family(n: int, k: int) -> Path:
    root = CACHE / f"family-many-{n}-{k}"
    if not root.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        from mergedb.synth import many_tensors

        tmp = Path(tempfile.mkdtemp(dir=CACHE))
        many_tensors(tmp, k, n)
        tmp.rename(root)
    return root


def child(mode: str, family: Path, db: Path, k: int, out: Path) -> dict:
    """One side's step in this process, imports done before the clock: `register` the K experts (the
    base first, untimed) into a new catalog, or plan and execute a full-read merge by method `mode`
    (cold: the family evicted first)."""
    from mergedb.catalog import Catalog
    from mergedb.executor import peak_rss
    from mergedb.planner import PlanRequest

    cat = Catalog(db)
    experts = [family / f"expert_{i:02d}" for i in range(k)]
    if mode == "register":
        cat.register([family / "base"], base=True)
        t, c = time.perf_counter(), time.process_time()
        cat.register(experts, base_model="base")
        return {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c, "peak_rss": peak_rss()}
    plan = cat.plan(PlanRequest("base", tuple(e.name for e in experts), mode, "all", params=METHODS[mode]))
    evict([p for d in (family / "base", *experts) for p in d.glob("*.safetensors")])
    t = time.perf_counter()
    r = cat.execute(plan.plan_id, out / mode)
    return {"seconds": time.perf_counter() - t, "peak_rss": peak_rss(), "content_hash": r.manifest["content_hash"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", type=Path, nargs="?")
    ap.add_argument("--tensors", type=int, default=5000)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--save", default="many-tensors")
    ap.add_argument("--label", help="what BASELINE is, for the report (a commit)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # MODE FAMILY CATALOG OUT
    ap.add_argument("--code", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.code:
            sys.path.insert(0, str(a.code.resolve()))
        mode, fam, db, out = a.child
        print("RESULT " + json.dumps(child(mode, Path(fam), Path(db), a.experts, Path(out))))
        return
    family = _family(a.tensors, a.experts)
    sides = [("new", None)] + ([("baseline", a.baseline.resolve())] if a.baseline else [])
    steps = ["register", *METHODS]
    runs: dict[str, dict[str, list[dict]]] = {label: {s: [] for s in steps} for label, _ in sides}
    for i in range(a.rounds):
        for label, code in sides if i % 2 == 0 else sides[::-1]:
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                for step in steps:
                    cmd = [sys.executable, "-m", "benchmarks.bench_many_tensors", "--experts", str(a.experts)]
                    cmd += ["--child", step, str(family), str(Path(tmp) / "c.duckdb"), tmp]
                    cmd += ["--code", str(code)] if code else []
                    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
                    r = json.loads(done.stdout.rsplit("RESULT ", 1)[1].splitlines()[0])
                    runs[label][step].append(r)
                    print(label, step, f"{r['seconds']:.2f} s", f"peak {r['peak_rss'] / 2**20:.0f} MiB")
    for method in METHODS:  # both sides merged the same bytes
        hashes = {r["content_hash"] for by_step in runs.values() for r in by_step[method]}
        if len(hashes) != 1:
            raise SystemExit(f"{method}: outputs differ between runs or sides: {sorted(hashes)}")
    summary = {
        f"{label}/{step}/{key}": statistics.median(r[key] for r in rs)
        for label, by_step in runs.items()
        for step, rs in by_step.items()
        for key in rs[0]
        if key != "content_hash"
    }
    doc = {"tensors": a.tensors, "experts": a.experts, "baseline": a.label or str(a.baseline)}
    doc |= {"runs": runs, "summary": summary}
    print(save(a.save, {**doc, "load_average_1min": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
