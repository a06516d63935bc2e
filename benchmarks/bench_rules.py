"""Access-set rules on a synthetic family: ‖θ_B − θ_F‖/‖θ_F − θ_0‖ of TIES and task arithmetic at
50 / 25 / 10% for the current ranked planner, the random ablation, --value consensus and
--min-coverage, and the plan's deviation estimate against the measured deviation.

    python -m benchmarks.bench_rules [--size small] [--experts 8] [--block-size 4MiB]

Every merge runs in memory in float32 (executor.merge_to_dict); the family and catalog are cached
under benchmarks/cache/rules/. Writes benchmarks/results/rules-SIZE-BLOCK.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import numpy as np

from mergedb import executor, synth
from mergedb.catalog import Catalog
from mergedb.errors import PlanError
from mergedb.planner import PlanRequest

from .common import CACHE, save

RULES = {  # name: (PlanRequest fields), methods it applies to
    "ranked": ({}, ("ties", "task_arithmetic")),
    "random": ({"strategy": "random"}, ("ties", "task_arithmetic")),
    "consensus": ({"value_model": "consensus"}, ("ties",)),
    "coverage 0.05": ({"min_coverage": 0.05}, ("ties", "task_arithmetic")),
    "coverage 0.2": ({"min_coverage": 0.2}, ("ties", "task_arithmetic")),
    "consensus + coverage 0.05": ({"value_model": "consensus", "min_coverage": 0.05}, ("ties",)),
}
PARAMS = {"ties": {"density": 0.2}, "task_arithmetic": {}}


def _distance(got: dict, full: dict, base: dict) -> tuple[float, float]:
    err = upd = 0.0
    for name, f in full.items():
        if name not in base or f.dtype.kind != "f":
            continue
        err += float(((got[name].astype(np.float64) - f) ** 2).sum())
        upd += float(((f.astype(np.float64) - base[name]) ** 2).sum())
    return math.sqrt(err), math.sqrt(upd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--block-size", default="4MiB")
    ap.add_argument("--budgets", default="50%,25%,10%")
    a = ap.parse_args()
    root = CACHE / "rules"
    fam = root / f"family-{a.size}-{a.experts}"
    if not (fam / f"expert_{a.experts - 1:02d}" / "config.json").exists():
        synth.make_family(fam, experts=a.experts, size=a.size, seed=0)
    cat = Catalog(root / f"catalog-{a.size}-{a.experts}-{a.block_size}.duckdb")
    cat.register([fam], base_model="base", block_size=a.block_size)
    rows = []
    for method, params in PARAMS.items():
        req = PlanRequest("base", None, method, "all", params=params)
        base = executor.merge_to_dict(cat.execution_plan(cat.plan(replace(req, budget="0")).plan_id), dtype="fp32")
        full = executor.merge_to_dict(cat.execution_plan(cat.plan(req).plan_id), dtype="fp32")
        for budget in a.budgets.split(","):
            for rule, (fields, applies) in RULES.items():
                if method not in applies:
                    continue
                try:
                    p = cat.plan(replace(req, budget=budget, estimate=True, **fields))
                except PlanError as e:  # a coverage that cannot fit the budget
                    rows.append({"method": method, "budget": budget, "rule": rule, "refused": str(e)})
                    print(f"| {method} | {budget} | {rule} | refused | | |", flush=True)
                    continue
                got = executor.merge_to_dict(cat.execution_plan(p.plan_id), dtype="fp32")
                err, upd = _distance(got, full, base)
                rows.append(
                    {
                        "method": method,
                        "budget": budget,
                        "rule": rule,
                        "selected_bytes": p.selected_bytes,
                        "deviation": err / upd,
                        "measured": err,
                        "estimate": p.est_error,
                        "est_kind": p.est_kind,
                        "planning_seconds": p.planning_seconds,
                    }
                )
                cells = [method, budget, rule, f"{err / upd:.3f}", f"{err:.3g}", f"{p.est_error:.3g}"]
                print("| " + " | ".join(cells) + " |", flush=True)
    save(
        f"rules-{a.size}-{a.block_size}",
        {"size": a.size, "experts": a.experts, "block_size": a.block_size, "rows": rows},
    )


if __name__ == "__main__":
    main()
