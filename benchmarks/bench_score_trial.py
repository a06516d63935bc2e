"""Issue 16's size-neutral score on the demo family: deviation of task arithmetic (λ = 0.5) at 50%
/ 10% under 4 MiB, `auto` and 64 KiB blocks, with --value norm and --value norm-sqrt; and the same
two value models on LoRA adapters (`--adapters`).

    python -m benchmarks.bench_score_trial WORKDIR [--adapters]

Builds `mergedb demo`'s family (16 experts, size small, seed 0) once, registers it three times, plans
and merges; prints ‖θ_B − θ_F‖ / ‖θ_F − θ_0‖ (θ_F: that catalog's full merge) and the plans' bounds
and estimates. `--adapters`: 9 PEFT adapters on that family's base (benchmarks.bench_lora's
factors: 3 each of rank 4, 16 and 64, so blocks of one tensor cost 4–64 bytes a row across
experts), task arithmetic at 50 / 25 / 10%. Accuracy only: nothing here is timed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.demo import _load, _norm
from mergedb.planner import PlanRequest


def main(workdir: Path) -> list[dict]:
    fam = workdir / "family"
    if not fam.is_dir():
        synth.make_family(fam, experts=16, size="small", seed=0)
    base = _load(fam / "base")
    rows = []
    for block in ("4MiB", "auto", "64KiB"):
        cat = Catalog(workdir / f"cat-{block}.duckdb")
        if not (workdir / f"cat-{block}.duckdb").exists():
            cat.register([fam], base_model="base", block_size=block)
        full_plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "100%", params={"lambda": 0.5}))
        cat.execute(full_plan.plan_id, workdir / f"full-{block}", force=True)
        full = _load(workdir / f"full-{block}")
        update = _norm(full, base)
        for value in ("norm", "norm-sqrt"):
            for budget in ("50%", "10%"):
                req = PlanRequest("base", None, "task_arithmetic", budget, params={"lambda": 0.5}, value_model=value)
                p = cat.plan(req)
                out = workdir / f"m-{block}-{value}-{budget.rstrip('%')}"
                cat.execute(p.plan_id, out, force=True)
                dev = _norm(_load(out), full) / update
                bound = p.bound_rounded if p.bound_rounded is not None else (p.bound_blockwise or 0.0)
                row = {"block": block, "value": value, "budget": budget, "dev": dev, "bound": bound / update}
                row["est"] = getattr(p, "est_error", None)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def adapters(workdir: Path) -> list[dict]:
    from benchmarks.bench_lora import make_adapters

    fam = workdir / "family"
    if not fam.is_dir():
        synth.make_family(fam, experts=16, size="small", seed=0)
    paths = [p for i, r in enumerate((4, 16, 64)) for p in make_adapters(fam / "base", workdir / f"ad-r{r}", 3, r, i)]
    db = workdir / "cat-adapters.duckdb"
    cat = Catalog(db)
    if not db.exists() or not cat.sql("SELECT count(*) AS n FROM checkpoints").to_pylist()[0]["n"]:
        cat.register([fam / "base"], base=True)
        for p, name in zip(paths, [f"{p.parent.name}-{p.name}" for p in paths], strict=True):
            cat.register([p], base_model="base", name=name)
    base = _load(fam / "base")
    full_plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "100%", params={"lambda": 0.5}))
    cat.execute(full_plan.plan_id, workdir / "full-adapters", force=True)
    full = _load(workdir / "full-adapters")
    update = _norm(full, base)
    rows = []
    for value in ("norm", "norm-sqrt"):
        for budget in ("50%", "25%", "10%"):
            req = PlanRequest("base", None, "task_arithmetic", budget, params={"lambda": 0.5}, value_model=value)
            p = cat.plan(req)
            out = workdir / f"m-adapters-{value}-{budget.rstrip('%')}"
            cat.execute(p.plan_id, out, force=True)
            row = {"family": "adapters", "value": value, "budget": budget, "dev": _norm(_load(out), full) / update}
            row["bound"] = (p.bound_blockwise or 0.0) / update
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    if "--adapters" in sys.argv[2:]:
        from benchmarks.common import save

        print(save("score_adapters", {"adapters": "3 each of rank 4, 16, 64", "rows": adapters(Path(sys.argv[1]))}))
    else:
        main(Path(sys.argv[1]))
