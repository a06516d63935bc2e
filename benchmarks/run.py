"""The benchmark suite: python -m benchmarks.run [--quick] [--only NAME ...]

Every configuration runs in a fresh `mergedb execute` process on a cold page cache (all inputs
evicted with POSIX_FADV_DONTNEED first), so wall time, physical reads and peak RSS are that
process's own. Families are built with mergedb.synth and cached under benchmarks/cache/.
Results: benchmarks/results/<name>.json, PNG plots there, and a regenerated
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest
from mergedb.units import DEFAULT_LAYOUT

from .common import CACHE, compiled, evict, save, sequential_read

CLI = [sys.executable, "-m", "mergedb.cli"]
METHOD_PARAMS = {
    "linear": {},
    "task_arithmetic": {"lambda": 0.5},
    "ties": {"density": 0.2},
    "dare_linear": {"density": 0.5},
    "dare_ties": {"density": 0.5},
    "breadcrumbs": {"density": 0.9, "gamma": 0.01},
    "breadcrumbs_ties": {"density": 0.9, "gamma": 0.01},
    "della": {"density": 0.7, "epsilon": 0.15},
    "della_linear": {"density": 0.7, "epsilon": 0.15},
    "model_stock": {},
}


class Suite:
    def __init__(self, quick: bool, repeats: int, threads: int | None = None) -> None:
        self.quick = quick
        self.exec_threads = threads  # --threads of every execution (None: the executor's default, all cores)
        self.size = "tiny" if quick else "bench"
        self.kmax = 4 if quick else 20
        self.repeats = repeats
        self.block_size = DEFAULT_LAYOUT  # the layout `mergedb register` gives a new base

    # -- families and catalogs ---------------------------------------------------------------

    def family(self, size: str | None = None) -> Path:
        size = size or self.size
        fam = CACHE / f"family-{size}-{self.kmax}"
        if not (fam / f"expert_{self.kmax - 1:02d}" / "config.json").exists():
            shutil.rmtree(fam, ignore_errors=True)
            synth.make_family(fam, experts=self.kmax, size=size, seed=0)
        return fam

    def catalog(self, size: str | None = None, block_size: str | None = None) -> Catalog:
        """The family's catalog at `block_size` (default: registration's default layout, `auto` since
        issue 16; results before 2026-12-01 10:30 UTC were measured at 4 MiB)."""
        size = size or self.size
        block_size = block_size or self.block_size
        cat = Catalog(CACHE / f"catalog-{size}-{self.kmax}-{block_size}.duckdb")
        cat.register([self.family(size)], base_model="base", block_size=block_size)
        return cat

    def experts(self, k: int) -> tuple[str, ...]:
        return tuple(f"expert_{i:02d}" for i in range(k))

    # -- one cold execution in its own process -------------------------------------------------

    def execute(
        self,
        cat: Catalog,
        plan_id: int,
        size: str | None = None,
        dtype: str | None = None,
        threads: int | None = None,
        tree: Path | None = None,
    ) -> dict:
        """One cold `mergedb execute` process; `tree`: a folder holding another mergedb package to run
        (PYTHONPATH; the process then runs outside the checkout, which `-m` would put first)."""
        fam = self.family(size)
        out = CACHE / "out"
        shutil.rmtree(out, ignore_errors=True)
        evict(list(fam.rglob("*.safetensors")))
        compiled(tree)
        t0 = time.perf_counter()
        cmd = CLI + ["execute", str(plan_id), "--out", str(out), "-c", str(cat.path), "-q"]
        if dtype:
            cmd += ["--dtype", dtype]
        threads = threads or self.exec_threads
        if threads:
            cmd += ["--threads", str(threads)]
        env = {**os.environ, "PYTHONPATH": str(tree)} if tree else None
        subprocess.run(cmd, check=True, env=env, cwd=CACHE if tree else None)
        wall = time.perf_counter() - t0
        run = json.loads((out / "mergedb_manifest.json").read_text())["run"]
        return {
            "process_seconds": wall,
            "execute_seconds": run["seconds"],
            "expert_bytes": run["expert_bytes_logical"],
            "physical_bytes": run["physical_read_bytes"],
            "base_bytes": run["base_bytes"],
            "peak_rss_mib": run["peak_rss_bytes"] / 2**20,
            "content_hash": json.loads((out / "mergedb_manifest.json").read_text())["content_hash"],
        }

    def best_of(self, cat: Catalog, plan_id: int, **kw) -> dict:
        runs = [self.execute(cat, plan_id, **kw) for _ in range(self.repeats)]
        best = min(runs, key=lambda r: r["execute_seconds"])
        return {**best, "runs": [r["execute_seconds"] for r in runs]}

    # -- benchmarks ------------------------------------------------------------------------------

    def physical(self) -> dict:
        fam = self.family()
        paths = [p for i in range(min(8, self.kmax)) for p in sorted((fam / f"expert_{i:02d}").glob("*.safetensors"))]
        rates = []
        for _ in range(self.repeats):
            n, t = sequential_read(paths)
            rates.append(n / t / 1e9)
        return {"bytes": n, "gbps_runs": rates, "gbps": max(rates)}

    def execute_targets(self) -> dict:
        """Issue 4: 10% vs 100% at K=8 (wall time and expert bytes), peak RSS at K=2 vs K=8."""
        cat = self.catalog()
        k = min(8, self.kmax)
        out = {}
        for budget in ("all", "10%"):
            p = cat.plan(PlanRequest("base", self.experts(k), "task_arithmetic", budget, params={"lambda": 0.5}))
            out[budget] = {
                **self.best_of(cat, p.plan_id),
                "budget_bytes": p.budget_bytes,
                "selected_bytes": p.selected_bytes,
                "planning_seconds": p.planning_seconds,
            }
        for kk in (2, k):
            p = cat.plan(PlanRequest("base", self.experts(kk), "ties", "all", params={"density": 0.2}))
            out[f"rss_k{kk}"] = self.best_of(cat, p.plan_id)
        out["k"] = k
        out["speedup_10pct"] = out["all"]["execute_seconds"] / out["10%"]["execute_seconds"]
        out["rss_growth_k2_to_k8"] = out[f"rss_k{k}"]["peak_rss_mib"] / out["rss_k2"]["peak_rss_mib"] - 1
        return out

    def scaling(self) -> dict:
        """Issue 5.1: expert bytes, wall time and peak RSS against K, per method and series."""
        cat = self.catalog()
        ks = [k for k in (2, 4, 8, 12, 16, 20) if k <= self.kmax]
        per_expert = cat.checkpoint("expert_00").bytes
        rows = []
        for method in ("task_arithmetic", "ties", "dare_ties"):
            for k in ks:
                for series, budget in (("full", "all"), ("two-experts", f"{2 * per_expert}B"), ("10%", "10%")):
                    p = cat.plan(PlanRequest("base", self.experts(k), method, budget, params=METHOD_PARAMS[method]))
                    r = self.best_of(cat, p.plan_id)
                    rows.append(
                        {
                            "method": method,
                            "k": k,
                            "series": series,
                            "budget_bytes": p.budget_bytes,
                            "selected_bytes": p.selected_bytes,
                            "planning_seconds": p.planning_seconds,
                            **r,
                        }
                    )
                    print(rows[-1]["method"], k, series, round(r["execute_seconds"], 2), flush=True)
                mk = self.mergekit(method, k)
                if mk:
                    rows.append({"method": method, "k": k, "series": "mergekit", **mk})
        return {"rows": rows}

    def threads(self) -> dict:
        """Issue 11: 1 vs 2 compute threads per method, full read and 10%, K=8; the output must not change."""
        cat = self.catalog()
        k = min(8, self.kmax)
        methods = ("task_arithmetic", "ties", "dare_ties") if self.quick else tuple(METHOD_PARAMS)
        rows = []
        for method in methods:
            for budget in ("all", "10%"):
                p = cat.plan(PlanRequest("base", self.experts(k), method, budget, params=METHOD_PARAMS[method]))
                by_threads = {n: self.best_of(cat, p.plan_id, threads=n) for n in (1, 2)}
                if by_threads[1]["content_hash"] != by_threads[2]["content_hash"]:
                    raise SystemExit(f"{method} {budget}: the output differs between 1 and 2 threads")
                one, two = by_threads[1], by_threads[2]
                rows.append(
                    {
                        "method": method,
                        "k": k,
                        "budget": budget,
                        "read_bytes": one["expert_bytes"] + one["base_bytes"],
                        "seconds_1": one["execute_seconds"],
                        "seconds_2": two["execute_seconds"],
                        "speedup_2": one["execute_seconds"] / two["execute_seconds"],
                        "peak_rss_mib_1": one["peak_rss_mib"],
                        "peak_rss_mib_2": two["peak_rss_mib"],
                    }
                )
                print(method, budget, f"1: {one['execute_seconds']:.2f}s 2: {two['execute_seconds']:.2f}s", flush=True)
        return {"rows": rows}

    def fidelity(self) -> dict:
        """Issue 5.2: measured error against budget, with the plan's bound and a random mask."""
        rows = []
        for size, methods in (
            (self.size, ("task_arithmetic", "ties")),
            ("tiny" if self.quick else "small", tuple(METHOD_PARAMS)),
        ):
            cat = self.catalog(size)
            k = min(8, self.kmax)
            full = self.merged(cat, size, k, "task_arithmetic", "all")
            base = _load(self.family(size) / "base")
            for method in methods:
                full = self.merged(cat, size, k, method, "all")
                for budget in ("100%", "75%", "50%", "25%", "10%", "5%"):
                    for strategy in ("ranked", "random"):
                        p = cat.plan(
                            PlanRequest(
                                "base", self.experts(k), method, budget, params=METHOD_PARAMS[method], strategy=strategy
                            )
                        )
                        got = self.merged(cat, size, k, method, budget, p)
                        rows.append(
                            {
                                "size": size,
                                "method": method,
                                "budget": budget,
                                "strategy": strategy,
                                "selected_bytes": p.selected_bytes,
                                "bound": p.bound_blockwise,
                                "estimate": p.est_error,
                                **_errors(got, full, base),
                            }
                        )
                print(size, method, "done", flush=True)
        return {"rows": rows}

    def merged(self, cat: Catalog, size: str, k: int, method: str, budget: str, plan=None) -> dict:
        from mergedb import executor

        if plan is None:
            plan = cat.plan(PlanRequest("base", self.experts(k), method, budget, params=METHOD_PARAMS[method]))
        return executor.merge_to_dict(cat.execution_plan(plan.plan_id), dtype="fp32")

    def overheads(self) -> dict:
        from . import bench_register

        reg = bench_register.run(self.size, min(4, self.kmax), self.repeats)
        return {"register": reg}

    def blocksize(self) -> dict:
        rows = []
        k = min(8, self.kmax)
        for bs in ("256KiB", "1MiB", "4MiB", "16MiB"):
            cat = self.catalog(block_size=bs)
            full = cat.plan(PlanRequest("base", self.experts(k), "task_arithmetic", "all", params={"lambda": 0.5}))
            r = self.best_of(cat, full.plan_id)
            ref = self.merged(cat, self.size, k, "task_arithmetic", "all")
            base = _load(self.family() / "base")
            for budget in ("50%", "10%"):
                p = cat.plan(PlanRequest("base", self.experts(k), "task_arithmetic", budget, params={"lambda": 0.5}))
                rows.append(
                    {
                        "block_size": bs,
                        "budget": budget,
                        "full_read_seconds": r["execute_seconds"],
                        "full_read_gbps": r["expert_bytes"] / r["execute_seconds"] / 1e9,
                        **_errors(self.merged(cat, self.size, k, "task_arithmetic", budget, p), ref, base),
                    }
                )
        return {"rows": rows}

    def parity(self) -> dict:
        """mergekit parity (issue 12): every config on fp32 and bf16 families; --quick: a few, fp32."""
        from . import parity

        if self.quick:
            return parity.suite_doc(CACHE / "parity", "tiny", ["fp32"], list(parity.QUICK))
        return parity.suite_doc(CACHE / "parity", "small", ["fp32", "bf16"], None)

    def mergekit(self, method: str, k: int) -> dict | None:
        exe = CACHE / "mergekit-venv" / "bin" / "mergekit-yaml"
        if not exe.exists():
            print("mergekit series skipped: no benchmarks/cache/mergekit-venv (pip install mergekit there)", flush=True)
            return None
        fam = self.family()
        names = {"task_arithmetic": "task_arithmetic", "ties": "ties", "dare_ties": "dare_ties"}
        params = {
            "task_arithmetic": {"weight": 1.0},
            "ties": {"weight": 1.0, "density": 0.2},
            "dare_ties": {"weight": 1.0, "density": 0.5},
        }[method]
        cfg = {
            "merge_method": names[method],
            "base_model": str(fam / "base"),
            "dtype": "float32",
            "out_dtype": "bfloat16",
            "parameters": {"lambda": 0.5} if method == "task_arithmetic" else {},
            "models": [{"model": str(fam / e), "parameters": params} for e in self.experts(k)],
        }
        cfg_path = CACHE / "mergekit.yml"
        cfg_path.write_text(json.dumps(cfg))
        out = CACHE / "mergekit-out"
        shutil.rmtree(out, ignore_errors=True)
        evict(list(fam.rglob("*.safetensors")))
        t0 = time.perf_counter()
        r = subprocess.run(
            ["/usr/bin/time", "-f", "%M", str(exe), str(cfg_path), str(out), "--random-seed", "0", "--lazy-unpickle"],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            print("mergekit failed:", r.stderr[-2000:], flush=True)
            return {"error": r.stderr[-500:]}
        rss = int(r.stderr.strip().splitlines()[-1]) / 1024
        doc = {
            "execute_seconds": wall,
            "process_seconds": wall,
            "peak_rss_mib": rss,
            "expert_bytes": sum(p.stat().st_size for e in self.experts(k) for p in (fam / e).glob("*.safetensors")),
        }
        if k == min(8, self.kmax):  # deviation between mergekit's output and mergedb's full-budget output
            from mergedb import executor

            cat = self.catalog()
            plan = cat.plan(PlanRequest("base", self.experts(k), method, "all", params=METHOD_PARAMS[method]))
            mdb = CACHE / "mergedb-out"
            shutil.rmtree(mdb, ignore_errors=True)
            executor.execute(cat.execution_plan(plan.plan_id), mdb)
            doc["deviation_from_mergedb"] = _errors(_load(out), _load(mdb), _load(fam / "base"))
        return doc


def _load(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(str(f)).items() if v.is_floating_point()})
    return out


def _errors(got: dict, full: dict, base: dict) -> dict:
    num = den_f = den_u = 0.0
    worst = 0.0
    for name, f in full.items():
        if f.dtype.kind != "f" or name not in base:
            continue
        d = got[name].astype(np.float64) - f
        e2, f2, u2 = (
            float((d * d).sum()),
            float((f.astype(np.float64) ** 2).sum()),
            float(((f - base[name].astype(np.float64)) ** 2).sum()),
        )
        num, den_f, den_u = num + e2, den_f + f2, den_u + u2
        if u2 > 0:
            worst = max(worst, np.sqrt(e2 / u2))
    err = np.sqrt(num)
    return {
        "abs_error": err,
        "rel_to_model": err / np.sqrt(den_f),
        "rel_to_update": err / np.sqrt(den_u) if den_u else 0.0,
        "worst_tensor_rel_to_update": worst,
    }


BENCHES = ["physical", "execute_targets", "threads", "scaling", "fidelity", "overheads", "blocksize", "parity"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: minutes")
    ap.add_argument("--only", nargs="*", choices=BENCHES)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="mergedb execute --threads [default: all cores]")
    a = ap.parse_args()
    suite = Suite(a.quick, a.repeats or (1 if a.quick else 2), a.threads)
    for name in a.only or BENCHES:
        t0 = time.perf_counter()
        doc = getattr(suite, name)()
        doc["seconds"] = time.perf_counter() - t0
        doc["default_block_size"] = suite.block_size  # its catalogs' layout unless it names another
        suffix = "-quick" if a.quick else ""
        print(save(name + suffix, {"quick": a.quick, **doc}), flush=True)
    from .report import write_report

    write_report(quick=a.quick)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
