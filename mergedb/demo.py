"""`mergedb demo`: a small synthetic family, registered, planned at three budgets, executed, compared."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import executor, synth
from .catalog import Catalog
from .planner import PlanRequest


@dataclass(frozen=True)
class DemoRow:
    budget: str
    expert_bytes: int
    physical_bytes: int
    seconds: float
    speedup: float
    rel_to_model: float  # ‖θ_B − θ_F‖ / ‖θ_F‖
    rel_to_update: float  # ‖θ_B − θ_F‖ / ‖θ_F − θ_0‖
    bound_rel: float  # the plan's block-wise bound / ‖θ_F − θ_0‖


def run_demo(
    workdir: str | Path, experts: int = 6, size: str = "small", method: str = "task_arithmetic"
) -> list[DemoRow]:
    """Build `workdir/family`, register it in `workdir/mergedb.duckdb`, merge at 100/50/10%."""
    workdir = Path(workdir)
    if workdir.exists():
        shutil.rmtree(workdir)
    fam = synth.make_family(workdir / "family", experts=experts, size=size, seed=0)
    cat = Catalog(workdir / "mergedb.duckdb")
    cat.register([fam], base_model="base")
    merged: dict[str, dict[str, np.ndarray]] = {}
    rows = []
    base = None
    full_seconds = 0.0
    for budget in ("100%", "50%", "10%"):
        plan = cat.plan(PlanRequest("base", None, method, budget, params={"lambda": 0.5}))
        xp = cat.execution_plan(plan.plan_id)
        out = workdir / f"merged-{budget.rstrip('%')}"
        res = executor.execute(xp, out, dtype="fp32")
        cat.record_run(plan.plan_id, str(out), res)
        merged[budget] = executor.merge_to_dict(xp, dtype="fp32") if budget == "100%" else _load(out)
        if base is None:
            base = _load(fam / "base")
        if budget == "100%":
            full_seconds = res.seconds
        diff = _norm(merged[budget], merged["100%"])
        upd = _norm(merged["100%"], base)
        rows.append(
            DemoRow(
                budget,
                res.expert_bytes,
                res.physical_bytes,
                res.seconds,
                full_seconds / res.seconds if res.seconds else 0.0,
                diff / _norm(merged["100%"], None),
                diff / upd if upd else 0.0,
                (plan.bound_blockwise or 0.0) / upd if upd else 0.0,
            )
        )
    return rows


def _load(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(str(f)).items() if v.is_floating_point()})
    return out


def _norm(a: dict[str, np.ndarray], b: dict[str, np.ndarray] | None) -> float:
    total = 0.0
    for k, v in a.items():
        if v.dtype.kind != "f":
            continue
        x = _f64(v) - (_f64(b[k]) if b is not None else 0.0)
        total += float(np.sum(x * x))
    return float(np.sqrt(total))


def _f64(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float64)
