"""One sweep of N TIES merges against N separate `mergedb execute` runs, N mergekit runs, and one run alone.

On the bench family (benchmarks/cache/family-bench-20, K experts of it), with a copy of its catalog
(the shared catalog is never written). Two grids per N: `lambda` (N/2 densities × λ ∈ {0.5, 1}: plans
that differ only in λ share their fold) and `density` (N densities, λ = 1: every plan folds alone,
so only reads are shared). Each arm starts from a cold page cache (every family file evicted) and
runs in processes of its own: wall time, expert bytes asked for (logical), bytes fetched from
storage (/proc read_bytes; mergekit: the children's rusage block inputs), peak RSS (VmHWM;
mergekit: /usr/bin/time). The N separate runs go back to back, as a person would run them, so after
the first they find the family in the page cache when it fits in memory. Outputs go to a temporary
folder, removed after each arm; each sweep output's content hash is checked against the separate
run of the same plan.

mergekit (0.1.5 in benchmarks/cache/mergekit-venv; ~80 s a TIES run here) runs M configs of the
first grid (`--mergekit-runs`, default 2) and its N-run figures are N × their mean, labelled
"extrapolated from M runs"; `--mergekit-all` runs all N of every grid. The machine's load
(`uptime`) is recorded before each arm.

`--separate-runs M` measures only the first M of the N separate runs and extrapolates them the same
way (N × their mean, labelled), for a loaded machine where 32 separate runs take too long.

Run: python -m benchmarks.bench_sweep [--n 8 32] [--k 8] [--mergekit-runs 2] [--separate-runs M] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
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

from .common import CACHE, RESULTS, evict, save

CLI = [sys.executable, "-m", "mergedb.cli"]
MERGEKIT_YAML = CACHE / "mergekit-venv" / "bin" / "mergekit-yaml"


def grids(n: int) -> dict[str, dict[str, list[float]]]:
    """The two grids of n TIES points: `lambda` (n/2 densities × λ 0.5, 1) and `density` (n densities)."""

    def dens(m: int) -> list[float]:
        return [round(0.05 + 0.9 * (i + 0.5) / m, 3) for i in range(m)]

    return {"lambda": {"density": dens(n // 2), "lambda": [0.5, 1.0]}, "density": {"density": dens(n)}}


def load() -> str:
    """`uptime`'s load averages: the machine is shared, so each arm's numbers carry it."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


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


def _children() -> tuple[float, int]:
    """CPU seconds (user + system) and bytes read from storage (block inputs × 512) of every finished
    child process so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime, r.ru_inblock * 512


def _execute(db: Path, plan_id: int, out: Path) -> dict:
    t0, (c0, _) = time.perf_counter(), _children()
    subprocess.run(CLI + ["execute", str(plan_id), "--out", str(out), "-c", str(db), "-q"], check=True)
    return {"wall": time.perf_counter() - t0, "cpu_seconds": _children()[0] - c0, **_run_record(out)}


def _mergekit(family: Path, experts: tuple[str, ...], params: dict, work: Path) -> dict:
    """One mergekit-yaml TIES run of `params` (density, lambda) over `experts`, cold cache."""
    cfg = {
        "merge_method": "ties",
        "base_model": str(family / "base"),
        "dtype": "float32",
        "out_dtype": "bfloat16",
        "parameters": {"lambda": params.get("lambda", 1.0), "normalize": True},
        "models": [
            {"model": str(family / e), "parameters": {"weight": 1.0, "density": params["density"]}} for e in experts
        ],
    }
    cfg_path, out = work / "mergekit.yml", work / "mergekit-out"
    cfg_path.write_text(json.dumps(cfg))
    shutil.rmtree(out, ignore_errors=True)
    evict(list(family.rglob("*.safetensors")))
    t0, (c0, r0) = time.perf_counter(), _children()
    cmd = ["/usr/bin/time", "-f", "%M", str(MERGEKIT_YAML), str(cfg_path), str(out), "--random-seed", "0"]
    r = subprocess.run([*cmd, "--lazy-unpickle", "--quiet"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cpu, phys = _children()
    shutil.rmtree(out, ignore_errors=True)
    if r.returncode != 0:
        raise SystemExit(f"mergekit-yaml failed: {r.stderr[-1500:]}")
    files = [p for e in experts for p in (family / e).glob("*.safetensors")]
    return {
        "params": params,
        "wall": wall,
        "cpu_seconds": cpu - c0,
        "expert_bytes": sum(p.stat().st_size for p in files),  # mergekit reads every expert file in full
        "physical_bytes": phys - r0,
        "peak_rss_bytes": int(r.stderr.strip().splitlines()[-1]) * 1024,
    }


def mergekit_arm(n: int, runs: list[dict]) -> dict:
    """N mergekit runs: measured (all N, `runs` then has N entries) or N × the mean of the M measured."""
    m = len(runs)
    mean = {k: sum(r[k] for r in runs) / m for k in ("wall", "cpu_seconds", "expert_bytes", "physical_bytes")}
    return {
        "measured_runs": m,
        "extrapolated": m < n,
        "label": f"extrapolated from {m} runs" if m < n else f"all {n} runs measured",
        "wall": n * mean["wall"],
        "cpu_seconds": n * mean["cpu_seconds"],
        "expert_bytes": n * mean["expert_bytes"],
        "physical_bytes": n * mean["physical_bytes"],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "runs": runs,
    }


def run(
    n: int, gname: str, k: int, family: Path, catalog: Path, work: Path, max_parallel: int | None, separate: int | None
) -> dict:
    """The one / sweep / separate arms of n plans of grid `gname`; `separate`: run only the first
    that many of the n separate executes and extrapolate (n × their mean, labelled)."""
    db = work / f"bench-sweep-{gname}-{n}.duckdb"
    shutil.copyfile(catalog, db)
    cat = Catalog(db)
    experts = tuple(f"expert_{i:02d}" for i in range(k))
    points = grids(n)[gname]
    reqs = grid.grid_requests(PlanRequest("base", experts, "ties", "all"), points, f"bench-{gname}-{n}x{k}")
    plans = grid.plan_all(cat, reqs)
    files = list(family.rglob("*.safetensors"))
    doc: dict = {"n": n, "k": k, "grid": gname, "points": points, "plans": [p.name for p in plans]}
    doc["selected_bytes"] = plans[0].selected_bytes

    doc["load_one"] = load()
    evict(files)
    doc["one"] = _execute(db, plans[0].plan_id, work / "one")
    shutil.rmtree(work / "one")

    doc["load_sweep"] = load()
    doc["disk_free_before_sweep"] = shutil.disk_usage(work).free
    evict(files)
    t0, (c0, _) = time.perf_counter(), _children()
    ids = [str(p.plan_id) for p in plans]
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_sweep", "--child", str(db), str(work / "sweep"),
         str(max_parallel or n), *ids],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if child.returncode != 0:  # kept in the results: the cause of a failed sweep is not lost again
        doc["sweep"] = {"failed": True, "returncode": child.returncode, "stderr": child.stderr[-4000:]}
        doc["disk_free_after_sweep"] = shutil.disk_usage(work).free
        shutil.rmtree(work / "sweep", ignore_errors=True)
        print(f"sweep of {n} ({gname}) failed, rc {child.returncode}:\n{child.stderr[-4000:]}", file=sys.stderr)
        return doc
    doc["sweep"] = {
        "wall": time.perf_counter() - t0,
        "cpu_seconds": _children()[0] - c0,
        "max_parallel": max_parallel or n,
        **json.loads(child.stdout.splitlines()[-1]),
    }
    hashes = {p.name: _run_record(work / "sweep" / p.name)["content_hash"] for p in plans}
    shutil.rmtree(work / "sweep")

    doc["load_separate"] = load()
    evict(files)
    runs = []
    for p in plans[: separate or n]:
        runs.append(_execute(db, p.plan_id, work / "separate" / p.name))
        if runs[-1]["content_hash"] != hashes[p.name]:
            raise SystemExit(f"sweep output of {p.name} differs from its separate run")
        shutil.rmtree(work / "separate" / p.name)
    scale = n / len(runs)  # 1 when every separate run was measured
    doc["separate"] = {
        "measured_runs": len(runs),
        "extrapolated": len(runs) < n,
        "wall": scale * sum(r["wall"] for r in runs),
        "cpu_seconds": scale * sum(r["cpu_seconds"] for r in runs),
        "expert_bytes": scale * sum(r["expert_bytes"] for r in runs),
        "physical_bytes": scale * sum(r["physical_bytes"] for r in runs),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "runs": runs,
    }
    doc["sweep_over_one"] = doc["sweep"]["wall"] / doc["one"]["wall"]
    doc["sweep_cpu_over_one"] = doc["sweep"]["cpu_seconds"] / doc["one"]["cpu_seconds"]
    doc["separate_over_sweep"] = doc["separate"]["wall"] / doc["sweep"]["wall"]
    doc["outputs_identical"] = True  # of the plans run separately (all, or the first `separate`)
    return doc


def _child(db: str, out: str, max_parallel: str, ids: list[str]) -> None:
    """The sweep arm, in its own process: prints the SweepResult's totals as one JSON line."""
    from mergedb import sweep

    res = sweep.sweep(Catalog(db), [int(i) for i in ids], out, max_parallel=int(max_parallel))
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
                "fold_groups": res.fold_groups,
                "folds_shared": res.folds_shared,
                "fold_passes": res.fold_passes,
                "base_bytes_read": res.base_bytes_read,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[8, 32], help="plans per sweep (even numbers)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--grids", nargs="+", default=["lambda", "density"], choices=["lambda", "density"])
    ap.add_argument("--max-parallel", type=int, default=None, help="plans in flight [default: all N]")
    ap.add_argument("--separate-runs", type=int, default=None, help="measure M of the N separate runs [default: all]")
    ap.add_argument("--mergekit-runs", type=int, default=2, help="M measured mergekit runs (0: no mergekit arm)")
    ap.add_argument("--mergekit-all", action="store_true", help="run all N mergekit merges of every grid")
    ap.add_argument("--mergekit-only", action="store_true", help="add the mergekit arm to results/sweep.json")
    ap.add_argument("--quick", action="store_true", help="a tiny family of 4 experts made for the run")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child[0], a.child[1], a.child[2], a.child[3:])
        return
    family, catalog = CACHE / "family-bench-20", CACHE / "catalog-bench-20-4MiB.duckdb"
    if not a.quick and not catalog.exists():
        raise SystemExit(f"no {catalog}: run `python -m benchmarks.run` first")
    k = min(a.k, 4) if a.quick else a.k
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")  # every entry says which run measured it (report.py compares)
    doc: dict = {"k": k, "sweeps": [], "load_start": load()}
    if a.mergekit_only:  # the sweeps of an earlier run, measured again against mergekit
        doc = {x: v for x, v in json.loads((RESULTS / "sweep.json").read_text()).items() if x != "machine"}
        k = doc["k"]
    with tempfile.TemporaryDirectory(prefix="mergedb-bench-sweep-") as work:
        if a.quick:
            family, catalog = synth.make_family(Path(work) / "fam", experts=4, size="tiny"), Path(work) / "src.duckdb"
            Catalog(catalog).register([family], base_model="base")
        for n in a.n if not a.mergekit_only else []:
            for g in a.grids:
                doc["sweeps"].append(
                    {**run(n, g, k, family, catalog, Path(work), a.max_parallel, a.separate_runs), "run": run_id}
                )
                last = doc["sweeps"][-1]
                print(
                    json.dumps({x: last.get(x) for x in ("n", "grid", "sweep_over_one", "sweep_cpu_over_one")}),
                    flush=True,
                )
                save("sweep" + ("-quick" if a.quick else ""), doc)  # what is done so far survives a crash
        if a.mergekit_runs and MERGEKIT_YAML.exists() and not a.quick:
            experts = tuple(f"expert_{i:02d}" for i in range(k))
            doc["mergekit"] = []
            measured: list[dict] = []
            for s in doc["sweeps"]:
                pts = [dict(zip(s["points"], v)) for v in itertools.product(*s["points"].values())]
                if a.mergekit_all:
                    runs = [_mergekit(family, experts, p, Path(work)) for p in pts]
                else:  # the first M points of the first grid, shared by every row
                    if not measured:
                        doc["load_mergekit"] = load()
                        measured = [_mergekit(family, experts, p, Path(work)) for p in pts[: a.mergekit_runs]]
                    runs = measured
                doc["mergekit"].append(
                    {"n": s["n"], "grid": s["grid"], **mergekit_arm(s["n"], runs), "run": run_id}
                )  # with --mergekit-only, another run than the sweeps': report.py then shows no ratio
    doc["load_end"] = load()
    print(json.dumps({x: v for x, v in doc.items() if x != "sweeps"}, indent=1, default=str))
    print(save("sweep" + ("-quick" if a.quick else ""), doc))


if __name__ == "__main__":
    main()
