"""`mergedb demo`: a small synthetic family, registered, planned at three budgets, executed, compared.

The demo writes into a folder it owns: a new or empty folder, which it marks with `.mergedb-demo`.
A rerun into a marked folder replaces only what the demo wrote there (family/, mergedb.duckdb,
merged-*/); any other non-empty folder is refused, never cleared.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import executor, synth
from .catalog import Catalog
from .errors import MergeDBError
from .planner import PlanRequest
from .tensorfile import DTYPES, as_float32, pread_into, read_header

MARKER = ".mergedb-demo"
BUDGETS = ("100%", "50%", "10%")
CATALOG = "mergedb.duckdb"
# What the demo writes into its folder, and so all a rerun may remove.
OWNED = ("family", CATALOG, f"{CATALOG}.wal", *(f"merged-{b.rstrip('%')}" for b in BUDGETS))


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
    """Build `workdir/family`, register it in `workdir/mergedb.duckdb`, merge at 100/50/10%.

    `workdir` must be new, empty, or a folder an earlier demo created (see the module docstring).
    """
    workdir = Path(workdir)
    prepare_workdir(workdir)
    fam = synth.make_family(workdir / "family", experts=experts, size=size, seed=0)
    cat = Catalog(workdir / CATALOG)
    cat.register([fam], base_model="base")
    merged: dict[str, dict[str, np.ndarray]] = {}
    rows = []
    base = None
    full_seconds = 0.0
    for budget in BUDGETS:
        plan = cat.plan(PlanRequest("base", None, method, budget, params={"lambda": 0.5}))
        xp = cat.execution_plan(plan.plan_id)
        out = workdir / f"merged-{budget.rstrip('%')}"
        res = cat.execute(plan.plan_id, out, dtype="fp32")
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


def prepare_workdir(workdir: Path) -> None:
    """Make `workdir` ready for a demo run without touching anything the demo did not write.

    A marked folder loses only the OWNED entries; a new or empty folder is created and marked;
    anything else raises MergeDBError before a single file is removed.
    """
    if (workdir / MARKER).is_file():
        for name in OWNED:
            p = workdir / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()  # a file, or a link (removed, its target left alone)
        return
    shown = f"{workdir} ({workdir.resolve()})" if not workdir.is_absolute() else str(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise MergeDBError(f"demo folder {shown} is a file; choose an empty or new --dir, e.g. mergedb demo --dir ./d")
    if workdir.is_dir() and any(workdir.iterdir()):
        raise MergeDBError(
            f"demo folder {shown} is not empty and was not created by `mergedb demo` (no {MARKER} in it); "
            "refusing to touch its contents: choose an empty or new --dir, e.g. mergedb demo --dir ./d"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).write_text(
        "Created by `mergedb demo`. A rerun replaces only: " + ", ".join(OWNED) + "; other files stay.\n"
    )


def _load(folder: Path) -> dict[str, np.ndarray]:
    """Every float tensor of the model in `folder`, decoded to float32 with mergedb's own reader."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        header = read_header(f)
        fd = os.open(f, os.O_RDONLY)
        try:
            for t in header.tensors:
                if t.dtype not in DTYPES or not DTYPES[t.dtype][2]:
                    continue  # integer buffers and the like: not part of the merge
                raw = np.empty(t.nbytes, np.uint8)
                pread_into(fd, memoryview(raw), t.start, f)
                f32 = as_float32(raw.view(DTYPES[t.dtype][1]), t.dtype, np.empty(t.numel, np.float32))  # (numel,)
                out[t.name] = f32.reshape(t.shape)
        finally:
            os.close(fd)
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
