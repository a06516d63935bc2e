"""A small, resumable search over merge weights and density with mergedb sweeps and scores.

    python examples/search.py --workdir search-demo --generations 6 --population 4

The first run makes a synthetic family (4 experts) in WORKDIR/family and registers it in
WORKDIR/search.duckdb. The target is a TIES merge with weights and density the search does not
know; the score of a candidate is its distance to the target, ‖θ − θ*‖ / ‖θ* − θ₀‖ over every
tensor (0: found it). Each generation proposes POPULATION candidates (weights in [0, 1] and a
density): the first at random, later ones around the best so far (a (1+λ) evolution strategy).
All candidates of a generation are merged together in memory by `Catalog.sweep` (each expert block
read once for the whole generation) and each score is stored with `Catalog.record_score`.

Kill it and start it again: it reads its scores back from the catalog (the plan_scores view) and
goes on with the first candidate that has no score. A generation's candidates depend only on the
seed and the scores of earlier generations, so a resumed search makes exactly the choices of one
never stopped. The plans are named `search-gGGG-cC`; `mergedb sql` queries them while it runs.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
from pathlib import Path

import numpy as np

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest

EXPERTS = 4
TARGET_WEIGHTS = (0.8, 0.2, 0.6, 0.4)
TARGET_DENSITY = 0.35
METRIC = "distance"
STEP = 0.15  # spread of a later generation around the best candidate


def setup(workdir: Path, size: str) -> Catalog:
    """The family and its catalog, made once (a rerun finds them)."""
    cat = Catalog(workdir / "search.duckdb", wait=30)
    family = workdir / "family"
    if not family.exists():  # made beside it and renamed into place: a run killed while writing it leaves no half
        partial = workdir / "family.partial"
        shutil.rmtree(partial, ignore_errors=True)
        synth.make_family(partial, experts=EXPERTS, size=size, seed=1)
        partial.rename(family)
    cat.register([family], base_model="base")  # idempotent
    return cat


def stored(cat: Catalog, name: str) -> bool:
    return bool(cat.sql("SELECT 1 FROM plans WHERE name = ?", [name]).num_rows)


def reference_states(cat: Catalog) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """θ* (the hidden target) and θ₀ (the base: task arithmetic with a zero budget), in memory."""
    target = PlanRequest(
        "base", None, "ties", weights=TARGET_WEIGHTS, params={"density": TARGET_DENSITY}, name="search-target"
    )
    base = PlanRequest("base", None, "task_arithmetic", budget="0", name="search-base")
    reqs = [r.name if stored(cat, r.name) else r for r in (target, base)]
    (_, t), (_, b) = cat.sweep(reqs)
    return t, b


def distance(state: dict[str, np.ndarray], target: dict[str, np.ndarray], base: dict[str, np.ndarray]) -> float:
    num = den = 0.0
    for k, t in target.items():
        if t.dtype.kind != "f":
            continue
        num += float(np.sum((state[k].astype(np.float64) - t) ** 2))
        den += float(np.sum((t.astype(np.float64) - base[k]) ** 2))
    return math.sqrt(num / den)


def scores(cat: Catalog) -> dict[str, tuple[float, tuple[float, ...], float]]:
    """plan name -> (distance, weights, density) of every scored candidate."""
    rows = cat.sql(
        "SELECT s.plan, s.value, CAST(s.params->>'density' AS DOUBLE) AS density, "
        "list(e.weight ORDER BY e.position) AS weights FROM plan_scores s JOIN plan_experts e USING (plan_id) "
        "WHERE s.metric = ? AND starts_with(s.plan, 'search-g') GROUP BY ALL ORDER BY s.plan",
        [METRIC],
    ).to_pylist()
    return {r["plan"]: (r["value"], tuple(r["weights"]), r["density"]) for r in rows}


def candidates(seed: int, gen: int, population: int, best: tuple[float, tuple[float, ...], float] | None) -> list:
    """(weights, density) of generation `gen`: random at first, then around the best so far."""
    rng = random.Random(seed * 100_003 + gen)
    out = []
    for _ in range(population):
        if best is None:
            w = tuple(round(rng.uniform(0, 1), 4) for _ in range(EXPERTS))
            d = round(rng.uniform(0.1, 0.9), 4)
        else:
            w = tuple(round(min(1.0, max(0.0, x + rng.gauss(0, STEP))), 4) for x in best[1])
            d = round(min(0.95, max(0.05, best[2] + rng.gauss(0, STEP / 2))), 4)
        out.append((w, d))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("search-demo"))
    ap.add_argument("--generations", type=int, default=6)
    ap.add_argument("--population", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="tiny", help="synthetic family size (tiny, small, ...)")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    cat = setup(args.workdir, args.size)
    target, base = reference_states(cat)
    done = scores(cat)
    if done:
        print(f"resuming: {len(done)} candidates already scored", flush=True)
    for gen in range(args.generations):
        earlier = [v for k, v in done.items() if k < f"search-g{gen:03d}"]
        best = min(earlier) if earlier else None
        names = [f"search-g{gen:03d}-c{c}" for c in range(args.population)]
        todo = [
            n if stored(cat, n) else PlanRequest("base", None, "ties", weights=w, params={"density": d}, name=n)
            for n, (w, d) in zip(names, candidates(args.seed, gen, args.population, best))
            if n not in done
        ]
        for plan, state in cat.sweep(todo, max_parallel=args.population) if todo else ():
            value = distance(state, target, base)
            cat.record_score(plan, METRIC, value)  # the summary: a plan forgotten meanwhile is refused
            done = scores(cat)
        top = min(v for k, v in done.items() if k < f"search-g{gen + 1:03d}")
        print(f"generation {gen}: best {METRIC} {top[0]:.4f} weights {top[1]} density {top[2]}", flush=True)
    top = min(done.values())
    print(f"best after {args.generations} generations: {METRIC} {top[0]:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
