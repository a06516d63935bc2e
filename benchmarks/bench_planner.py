"""Planning time and peak memory on simulated catalogs of 1M, 10M and 35M (expert, block) rows.

35M is issue 15's family: 1,000 experts × a 70B layout at 4 MiB blocks (~35,000 blocks each; here
700 tensors × 50 blocks, sketches of dimension 8 so that the catalog fits a small disk: a plan
reads no sketch above 2M omitted blocks). Each plan runs in a fresh process, so its peak RSS
(VmHWM) is its own; CPU seconds are reported beside wall seconds because the machine may be
shared (the load average at the start of each run is recorded); user and system CPU and minor page
faults are recorded apart, since page faults (fresh memory) were most of a large plan's cost.

Side by side: `--baseline DIR` (a checkout of older code, e.g. `git archive 7efc085 | tar -x -C DIR`)
runs each plan with that code too, alternating old and new in one run, and checks that both give
the same plan hash. `--small CATALOG` times small plans instead (the bench family, K = 8, full read:
issue 11's "planning ≤ 1% of execution"): task arithmetic and TIES, several per process, on a copy
of CATALOG (the cached catalog is never written; each side's copies are of one copy its own code
opened first, so a schema upgrade runs outside the timings), then the first plan of fresh processes; with
`--baseline`, one plan per COVERAGE request follows in each process and every stored plan table of
old and new code must be equal (the run stops if not).
Run: python -m benchmarks.bench_planner [--quick] [--catalog-dir DIR] [--rows 1000000 ...] [--baseline DIR]
     [--budgets 10% 25% 50%] [--save NAME]
     python -m benchmarks.bench_planner --small benchmarks/cache/catalog-bench-20-auto.duckdb [--baseline DIR]
     [--execute 3]
(--execute N: the small plans' full-read executions, N cold processes each, in the same run, one of
each after each round of plans: the report then takes "planning ≤ 1% of execution" against those
rather than execute_targets.json.)
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
from collections.abc import Callable
from pathlib import Path

from .common import CACHE, compiled, save

SHAPES = {  # rows -> (experts, tensors, blocks per tensor, sketch dim)
    20_000: (4, 5, 1000, None),
    1_000_000: (20, 50, 1000, None),
    10_000_000: (20, 500, 1000, None),
    35_000_000: (1000, 700, 50, 8),
}
BUDGETS = {
    20_000: ("10%", "50%"),
    1_000_000: ("10%", "50%"),
    10_000_000: ("10%", "50%"),
    35_000_000: ("10%", "25%", "50%"),
}


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


def _usage() -> dict:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user": r.ru_utime, "sys": r.ru_stime, "minflt": r.ru_minflt, "wall": time.perf_counter()}


def _since(u0: dict) -> dict:
    u1 = _usage()
    return {k: u1[k] - u0[k] for k in u0}


def one(db: Path, budget: str) -> dict:
    """Plan task arithmetic over every expert at `budget` in this process; time, CPU and memory."""
    from mergedb.catalog import Catalog
    from mergedb.planner import PlanRequest

    cat = Catalog(db)
    base = cat.checkpoints()[0].name
    load = os.getloadavg()[0]
    u0 = _usage()
    p = cat.plan(PlanRequest(base, None, "task_arithmetic", budget))
    d = _since(u0)
    hwm = next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
    return {
        "rows": p.n_candidates,
        "experts": len(p.experts),
        "method": "task_arithmetic",
        "budget": budget,
        "plan_seconds": d["wall"],
        "planner_reported_seconds": p.planning_seconds,
        "cpu_seconds": d["user"] + d["sys"],
        "user_seconds": d["user"],
        "sys_seconds": d["sys"],
        "minor_faults": d["minflt"],
        "plan_hash": p.plan_hash,
        "bound_sum": p.bound_sum,
        "selected_bytes": p.selected_bytes,
        "budget_bytes": p.budget_bytes,
        "n_selected": p.n_selected,
        "peak_rss_mib": hwm / 1024,
        "load_average_1min": load,
    }


SMALL = {"task_arithmetic": {"lambda": 0.5}, "ties": {"density": 0.2}}
# after the timed plans: one plan per request below, so that the stored tables of old and new code can
# be compared for every method and option (method, params, budget, experts, request options)
COVERAGE = [
    ("linear", {}, "all", 8, {}),
    ("task_arithmetic", {"lambda": 0.5}, "10%", 8, {"name": "ta-10pct", "seed": 7}),
    ("ties", {"density": 0.2}, "25%", 8, {}),
    ("ties", {"density": 0.137}, "all", 8, {}),  # off the density grid: thresholds from the summaries
    ("ties", {"density": 0.2}, "40%", 8, {"value_model": "consensus", "min_coverage": 0.1}),
    ("dare_linear", {}, "all", 8, {}),
    ("dare_ties", {}, "10%", 8, {"strategy": "random", "seed": 3}),
    ("breadcrumbs", {}, "all", 8, {}),
    ("breadcrumbs_ties", {}, "30%", 8, {}),
    ("della", {}, "all", 8, {}),
    ("della_linear", {}, "20%", 8, {"weights": (1.0, 0.5, 2.0, 1.0, 1.0, 0.25, 1.0, 3.0)}),
    ("model_stock", {}, "all", 8, {}),
    ("slerp", {"t": 0.3}, "50%", 1, {}),
    ("task_arithmetic", {"lambda": 1.0}, "15%", 20, {"estimate": True}),
]
# every stored plan table, in a fixed order (planning_seconds and created left out: times)
STORED = {
    "plans": "SELECT * EXCLUDE (planning_seconds, created) FROM plans ORDER BY plan_id",
    "plan_experts": "SELECT * FROM plan_experts ORDER BY plan_id, position",
    "plan_thresholds": "SELECT * FROM plan_thresholds ORDER BY plan_id, checkpoint_id, tensor_idx",
    "plan_mask_bits": "SELECT * REPLACE (CAST(selected AS VARCHAR) AS selected) FROM plan_mask_bits "
    "ORDER BY plan_id, checkpoint_id, tensor_idx",
    "plan_tensor_params": "SELECT * FROM plan_tensor_params ORDER BY plan_id, position, tensor_idx",
}


def stored_tables(cat) -> dict:
    """sha256 and row count of each stored plan table (exact: floats as repr, NaN as NaN)."""
    import hashlib

    out = {}
    for table, sql in STORED.items():
        # plans.rng (schema 014) is left out: a baseline before it has no such column, and every plan
        # of a mergedb that has it holds the same constant (methods.RNG)
        rows = [{k: v for k, v in r.items() if k != "rng"} for r in cat.sql(sql).to_pylist()]
        out[table] = [len(rows), hashlib.sha256(json.dumps(rows, default=str).encode()).hexdigest()]
    return out


def _time_make_plan(planner) -> list[float]:
    """Wrap planner.make_plan so that each call appends its CPU seconds (all threads) to the returned
    list: less sensitive to a busy machine than its wall time."""
    make_plan, cpu = planner.make_plan, []

    def timed(*args):
        t0 = time.process_time()
        try:
            return make_plan(*args)
        finally:
            cpu.append(time.process_time() - t0)

    planner.make_plan = timed
    return cpu


HASHES = ("plan_hash", "plan_hash_held")  # a small run's plan hashes: plans alone, and in a hold


def small(db: Path, repeats: int) -> dict:
    """Small plans in this process (the bench family, K = 8, full read): per plan, the planner's own
    planning_seconds (wall) and CPU seconds, the whole Catalog.plan call (connection included) and its CPU;
    then, where the code has Catalog.hold, the whole call of as many plans made inside one hold
    (held_call_seconds: no attach or checkpoint per plan; the hold's own opening and closing, once
    for them all, are held_open_close_seconds)."""
    from mergedb import planner
    from mergedb.catalog import Catalog
    from mergedb.planner import PlanRequest

    planning_cpu = _time_make_plan(planner)
    cat = Catalog(db)
    experts = tuple(f"expert_{i:02d}" for i in range(8))
    out = {}
    for method, params in SMALL.items():
        req = PlanRequest("base", experts, method, "all", params=params)
        cat.plan(req)  # warm: imports, first statements
        runs = []
        for _ in range(repeats):
            u0 = _usage()
            p = cat.plan(req)
            d = _since(u0)
            runs.append((p.planning_seconds, d["wall"], d["user"] + d["sys"], planning_cpu[-1]))
        out[method] = {
            "plan_hash": p.plan_hash,
            "planning_seconds": [r[0] for r in runs],
            "call_seconds": [r[1] for r in runs],
            "cpu_seconds": [r[2] for r in runs],
            "planning_cpu_seconds": [r[3] for r in runs],
        }
    hashes = []
    for method, params, budget, k, options in COVERAGE:
        names = tuple(f"expert_{i:02d}" for i in range(k))
        hashes.append(cat.plan(PlanRequest("base", names, method, budget, params=params, **options)).plan_hash)
    stored = stored_tables(cat)  # compared with the baseline's, which may predate Catalog.hold: before it
    for method, params in SMALL.items() if hasattr(cat, "hold") else ():
        req = PlanRequest("base", experts, method, "all", params=params)
        held, t0 = [], time.perf_counter()
        with cat.hold():
            for _ in range(repeats):
                t = time.perf_counter()
                p = cat.plan(req)
                held.append(time.perf_counter() - t)
        out[method]["held_call_seconds"] = held
        out[method]["held_open_close_seconds"] = time.perf_counter() - t0 - sum(held)
        out[method]["plan_hash_held"] = p.plan_hash
    return {"timed": out, "coverage_hashes": hashes, "stored": stored}


def first_plan(db: Path, method: str) -> dict:
    """The first plan of a fresh process (imports done, nothing else): its planning_seconds and the
    whole Catalog.plan call (connection, migration check, store, read back)."""
    from mergedb import planner
    from mergedb.catalog import Catalog
    from mergedb.planner import PlanRequest

    cpu = _time_make_plan(planner)
    t0 = time.perf_counter()
    p = Catalog(db).plan(
        PlanRequest("base", tuple(f"expert_{i:02d}" for i in range(8)), method, "all", params=SMALL[method])
    )
    call = time.perf_counter() - t0
    return {
        "planning_seconds": p.planning_seconds,
        "call_seconds": call,
        "plan_hash": p.plan_hash,
        "planning_cpu": cpu[0],
    }


def _child(args: list[str], code: Path | None) -> dict:
    compiled(code)
    cmd = [sys.executable, "-m", "benchmarks.bench_planner", *args] + (["--code", str(code)] if code else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
    # the child's stdout may hold DuckDB's progress bar: the result is the line marked RESULT
    return json.loads(res.stdout.rsplit("RESULT ", 1)[1].splitlines()[0])


def executions(catalog_path: Path, folder: Path) -> Callable[[], dict[str, dict]]:
    """The executions the planning share is taken of, in the same run and on the same catalog: each
    SMALL request's plan (K = 8, full read), made once on a copy of the catalog in `folder`; the
    function returned executes each of them once, cold, a `mergedb execute` process each
    (benchmarks/run.py's Suite.execute; the catalog's family must be the bench family). run_small
    calls it between its rounds of plans, so that a slow spell of the machine weighs on both."""
    from mergedb.catalog import Catalog
    from mergedb.planner import PlanRequest

    from .run import Suite

    suite = Suite(False, 1)
    db = folder / "executions.duckdb"
    shutil.copy(catalog_path, db)
    cat = Catalog(db)
    experts = tuple(f"expert_{i:02d}" for i in range(8))
    plan_ids = {m: cat.plan(PlanRequest("base", experts, m, "all", params=p)).plan_id for m, p in SMALL.items()}

    def once() -> dict[str, dict]:
        runs = {m: suite.execute(cat, plan_id) for m, plan_id in plan_ids.items()}
        print("execute", {m: round(r["execute_seconds"], 2) for m, r in runs.items()}, flush=True)
        return runs

    return once


def run_small(
    catalog_path: Path, baseline: Path | None, rounds: int = 3, repeats: int = 10, execute_runs: int = 0
) -> dict:
    """Small plans, new (and baseline) code alternating, `rounds` processes each, on copies of the
    catalog; then the first plan of a fresh process, `rounds` × 2 per method and side. With a
    baseline, every stored plan table (and plan hash) of the two sides must be equal. With
    `execute_runs`, the plans' executions (`executions`), one of each plan after each round of plans
    while `execute_runs` are not done (the rest after the rounds), so the planning share is of
    executions measured in the same run, in alternation with the plans, on the same catalog."""
    sides = [("baseline", baseline), ("new", None)] if baseline is not None else [("new", None)]
    out: dict[str, list] = {label: [] for label, _ in sides}
    first: dict[str, dict[str, list]] = {label: {m: [] for m in SMALL} for label, _ in sides}
    executed: dict[str, list[dict]] = {m: [] for m in SMALL}
    with tempfile.TemporaryDirectory() as tmp:
        execute_once = executions(catalog_path, Path(tmp)) if execute_runs else None

        def execute() -> None:
            assert execute_once is not None
            for m, r in execute_once().items():
                executed[m].append(r)

        master = {}  # each side's copy of the catalog, upgraded by its code once, outside the timings
        for label, code in sides:
            master[label] = Path(tmp) / f"master-{label}.duckdb"
            shutil.copy(catalog_path, master[label])
            _child(["--prepare", str(master[label])], code)
        for i in range(rounds):
            for label, code in sides if i % 2 == 0 else sides[::-1]:
                db = Path(tmp) / f"{label}-{i}.duckdb"
                shutil.copy(master[label], db)
                out[label].append(_child(["--small-one", str(db), str(repeats)], code))
                timed = out[label][-1]["timed"]
                print(label, {m: round(min(r["planning_seconds"]) * 1e3, 1) for m, r in timed.items()}, flush=True)
            if i < execute_runs:
                execute()
        for _ in range(rounds, execute_runs):
            execute()
        for i in range(2 * rounds):
            for method in SMALL:
                for label, code in sides if i % 2 == 0 else sides[::-1]:
                    db = Path(tmp) / f"first-{label}-{method}-{i}.duckdb"
                    shutil.copy(master[label], db)
                    first[label][method].append(_child(["--first-one", str(db), method], code))
        print(
            "first plan",
            {
                f"{lb}/{m}": [round(r["planning_seconds"] * 1e3, 1) for r in v]
                for lb in first
                for m, v in first[lb].items()
            },
        )
    if baseline is not None:
        for a, b in zip(out["baseline"], out["new"]):
            if a["stored"] != b["stored"] or a["coverage_hashes"] != b["coverage_hashes"]:
                raise SystemExit(f"stored plans differ between baseline and new code: {a['stored']} vs {b['stored']}")
    summary = {}
    for label, runs in out.items():
        for method in SMALL:
            keys = ("planning_seconds", "call_seconds", "cpu_seconds", "planning_cpu_seconds", "held_call_seconds")
            pooled = {k: [x for r in runs for x in r["timed"][method].get(k, [])] for k in keys}
            pooled = {k: v for k, v in pooled.items() if v}
            f = first[label][method]
            # per plan in a hold, its opening and closing shared out: (plans' calls + the hold's own) / plans
            held = [
                (sum(t["held_call_seconds"]) + t["held_open_close_seconds"]) / len(t["held_call_seconds"])
                for t in (r["timed"][method] for r in runs)
                if "held_call_seconds" in t
            ]
            summary[f"{label}/{method}"] = {
                **({"held_per_plan_seconds_median": statistics.median(held)} if held else {}),
                **{f"{k}_min": min(v) for k, v in pooled.items()},
                **{f"{k}_median": statistics.median(v) for k, v in pooled.items()},
                "first_planning_seconds_median": statistics.median(r["planning_seconds"] for r in f),
                "first_call_seconds_median": statistics.median(r["call_seconds"] for r in f),
                "first_planning_cpu_median": statistics.median(r.get("planning_cpu", float("nan")) for r in f),
                "plan_hashes": sorted(
                    {t[k] for t in (r["timed"][method] for r in runs) for k in HASHES if k in t}
                    | {r["plan_hash"] for r in f}
                ),
            }
    stored = {label: runs[0]["stored"] for label, runs in out.items()}
    hashes = {label: runs[0]["coverage_hashes"] for label, runs in out.items()}
    return {
        "catalog": catalog_path.name,
        "executions": executed if execute_runs else None,
        "small": out,
        "first_plan": first,
        "small_summary": summary,
        "stored_tables": stored,
        "coverage_hashes": hashes,
        "stored_equal": None if baseline is None else True,
        "load_average_1min": os.getloadavg()[0],
    }


def run(
    rows_list=(1_000_000, 10_000_000, 35_000_000),
    folder: Path = CACHE,
    baseline: Path | None = None,
    budgets: tuple[str, ...] | None = None,
) -> dict:
    """Each plan in a fresh process; with `baseline`, old and new code in the order old, new, new, old
    (neither always runs first, on a colder page cache), and their plan hashes must agree."""
    out, old = [], []
    for rows in rows_list:
        db = catalog(rows, folder)
        for budget in budgets or BUDGETS[rows]:
            order = [("baseline", baseline), ("new", None), ("new", None), ("baseline", baseline)]
            for label, code in order if baseline is not None else [("new", None)]:
                r = _child(["--one", str(db), budget], code)
                (old if label == "baseline" else out).append(r)
                print(label, r, flush=True)
            if baseline is not None and {r["plan_hash"] for r in old[-2:] + out[-2:]} != {out[-1]["plan_hash"]}:
                raise SystemExit(f"plan hashes differ at {rows} rows, {budget}: {old[-2:]} vs {out[-2:]}")
    return {"runs": out, "baseline_runs": old, "baseline": str(baseline) if baseline else None}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--catalog-dir", type=Path, default=CACHE)
    ap.add_argument("--rows", type=int, nargs="*", choices=sorted(SHAPES))
    ap.add_argument("--baseline", type=Path, help="a checkout of older code to run side by side")
    ap.add_argument("--budgets", nargs="*", help="budgets to plan at (default: BUDGETS of each size)")
    ap.add_argument("--save", default=None, help="results/<SAVE>.json (default planner[-quick])")
    ap.add_argument("--small", type=Path, metavar="CATALOG", help="time small plans on a copy of CATALOG")
    ap.add_argument("--execute", type=int, default=0, help="--small: then execute each plan N times, cold")
    ap.add_argument("--rounds", type=int, default=3, help="--small: processes per side (first plans: twice as many)")
    ap.add_argument("--one", nargs=2, metavar=("CATALOG", "BUDGET"), help=argparse.SUPPRESS)
    ap.add_argument("--small-one", nargs=2, metavar=("CATALOG", "REPEATS"), help=argparse.SUPPRESS)
    ap.add_argument("--first-one", nargs=2, metavar=("CATALOG", "METHOD"), help=argparse.SUPPRESS)
    ap.add_argument("--prepare", type=Path, metavar="CATALOG", help=argparse.SUPPRESS)
    ap.add_argument("--code", type=Path, help=argparse.SUPPRESS)  # a child: import mergedb from there
    a = ap.parse_args()
    if a.execute < 0 or a.rounds < 1:
        ap.error("--execute takes 0 or more executions per method, --rounds 1 or more rounds")
    if a.code:
        sys.path.insert(0, str(a.code.resolve()))
    if a.one:
        print("RESULT " + json.dumps(one(Path(a.one[0]), a.one[1])))
    elif a.small_one:
        print("RESULT " + json.dumps(small(Path(a.small_one[0]), int(a.small_one[1]))))
    elif a.first_one:
        print("RESULT " + json.dumps(first_plan(Path(a.first_one[0]), a.first_one[1])))
    elif a.prepare:  # a child: open the catalog once, which upgrades it to this code's schema
        from mergedb.catalog import Catalog

        print("RESULT " + json.dumps({"plans": len(Catalog(a.prepare).plans())}))
    elif a.small:
        print(save(a.save or "planner-small", run_small(a.small, a.baseline, a.rounds, execute_runs=a.execute)))
    else:
        rows = tuple(a.rows) if a.rows else ((20_000,) if a.quick else (1_000_000, 10_000_000, 35_000_000))
        doc = run(rows, a.catalog_dir, a.baseline, tuple(a.budgets) if a.budgets else None)
        print(save(a.save or "planner" + ("-quick" if a.quick else ""), doc))
