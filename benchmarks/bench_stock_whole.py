"""model_stock under a budget: ‖θ_B − θ_F‖/‖θ_F − θ_0‖ and the plan's estimate against it, on
tests/test_stock_whole.py's family (K = 8, six (64, 256) float32 tensors, 8 KiB blocks; --shared sets
each tensor's weight of the shared direction) and on tests/test_rules.py's synthetic one (--family rules).

    python -m benchmarks.bench_stock_whole [--family stock|rules] [--shared 0,0.3,0,0.6,0,0.2] [--mergedb PATH]

--mergedb: a checkout whose mergedb package to measure (e.g. a worktree of an older commit), put
first on sys.path; the family and the textbook reference are this checkout's. θ_F is the textbook
model_stock of the whole tensors (float64) for --family stock, the mergedb's own full-budget merge
for --family rules. Merges run in memory in float32 (executor.merge_to_dict). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

BUDGETS = ("10%", "25%", "50%", "75%", "90%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("stock", "rules"), default="stock")
    ap.add_argument("--shared", default=None, help="per-tensor weights of the shared direction, six numbers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mergedb", default=None, help="a checkout whose mergedb to measure")
    a = ap.parse_args()
    if a.mergedb:  # only the package comes from there: tests/ (the family) stays this checkout's
        sys.path.insert(0, str(Path(a.mergedb).resolve()))
    import mergedb

    if a.mergedb:
        sys.path.pop(0)
    from mergedb import executor, synth
    from mergedb.catalog import Catalog
    from mergedb.planner import PlanRequest
    from tests import test_stock_whole as fam

    root = Path(tempfile.mkdtemp(prefix="bench-stock-"))
    cat = Catalog(root / "catalog.duckdb")
    if a.family == "stock":
        if a.shared:
            fam.SHARED = tuple(float(x) for x in a.shared.split(","))
        base, experts = fam.make_family(root / "family", seed=a.seed)
        cat.register([root / "family"], base_model="base", block_size=fam.BLOCK_ROWS * fam.COLS * 4)
        full = {n: fam.textbook_model_stock(b, [e[n] for e in experts]) for n, b in base.items()}
    else:
        synth.make_family(root / "family", experts=8, size="tiny", dtype="fp32", seed=a.seed)
        cat.register([root / "family"], base_model="base", block_size=16 * 1024)
        plan = cat.plan(PlanRequest("base", None, "model_stock", "all"))
        full = executor.merge_to_dict(cat.execution_plan(plan.plan_id), dtype="fp32")
        plan = cat.plan(PlanRequest("base", None, "model_stock", "0"))
        base = executor.merge_to_dict(cat.execution_plan(plan.plan_id), dtype="fp32")
    full = {n: f.astype(np.float64) for n, f in full.items()}

    def distance(x: dict[str, np.ndarray]) -> float:
        return math.sqrt(sum(float(np.sum((x[n].astype(np.float64) - f) ** 2)) for n, f in full.items()))

    from_base = distance(base)
    print(f"mergedb: {Path(mergedb.__file__).parent}; family {a.family}; ‖θ_F − θ_0‖ = {from_base:.4g}\n")
    print(
        "| budget | read / budget bytes | tensors left at the base | ‖θ_B − θ_F‖ / ‖θ_F − θ_0‖ | estimate / measured |"
    )
    print("|---|---|---|---|---|")
    for budget in BUDGETS:
        p = cat.plan(PlanRequest("base", None, "model_stock", budget))
        got = executor.merge_to_dict(cat.execution_plan(p.plan_id), dtype="fp32")
        measured = distance(got)
        kept = sum(bool(np.array_equal(got[n], base[n])) for n in full)
        ratio = f"{p.est_error / measured:.2f}" if measured and p.est_error is not None else "–"
        row = (budget, f"{p.selected_bytes} / {p.budget_bytes}", f"{kept} / {len(full)}", f"{measured / from_base:.3f}")
        print("| " + " | ".join((*row, ratio)) + " |")
    shutil.rmtree(root)  # the family and its catalog: a few MB, rebuilt in seconds


if __name__ == "__main__":
    main()
