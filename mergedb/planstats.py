"""What the planner reads from the catalog per (expert, tensor): trim thresholds at each pair's
density, and SLERP's coefficients from ‖θ₀‖², ‖Δ‖² and ⟨θ₀, Δ⟩ (queries/slerp_stats.sql).

Runs inside the planner's transaction, on the connection it hands over.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from . import methods, stats
from .errors import PlanError
from .resources import query
from .tensorparams import TensorValues


def slerp_values(
    con: duckdb.DuckDBPyConnection, values: TensorValues, base_id: int, expert_id: int, expert: str
) -> TensorValues:
    """SLERP's per-tensor base scale s0 + s1 and coefficient s1 from the catalog alone
    (queries/slerp_stats.sql): θ₁ = θ₀ + Δ, so ‖θ₁‖² = ‖θ₀‖² + 2⟨θ₀,Δ⟩ + ‖Δ‖² and ⟨θ₀,θ₁⟩ = ‖θ₀‖² + ⟨θ₀,Δ⟩."""
    rows = con.execute(query("slerp_stats"), [base_id, expert_id]).fetchall()
    n = values.coef.shape[1]
    base_sq, delta_sq, dot = np.zeros(n), np.zeros(n), np.zeros(n)
    for tidx, bsq, dsq, bd, missing in rows:
        if missing:
            raise PlanError(
                f"slerp needs ⟨θ₀, Δ⟩ and ‖θ₀‖ per block, which this catalog lacks for {expert!r} (registered before "
                "mergedb stored them); register the family again into a new catalog (`mergedb register FOLDER "
                "--base-model BASE --catalog new.duckdb`) and plan there"
            )
        base_sq[tidx], delta_sq[tidx], dot[tidx] = bsq, dsq, bd
    scale, s1 = methods.slerp_coefficients(base_sq, delta_sq, dot, np.nan_to_num(values.t))
    return replace(values, coef=s1[None, :], scale=scale)


def thresholds(con: duckdb.DuckDBPyConnection, m: methods.Method, values: TensorValues, ids: list[int]) -> pa.Table:
    """Per (expert, tensor) trim thresholds at that pair's density (and γ): exact from the density
    grid when the density is on it, from the magnitude summary (within 0.8%) otherwise."""
    cols: dict[str, list[Any]] = {"checkpoint_id": [], "tensor_idx": [], "t_lo": [], "t_hi": [], "exact": []}
    if m.sparsify in ("magnitude", "band"):
        pos_of = {cid: i for i, cid in enumerate(ids)}
        rows = con.execute(
            "SELECT et.checkpoint_id, et.tensor_idx, et.grid_threshold, et.summary_code, et.summary_count, ft.numel "
            "FROM expert_tensors et JOIN checkpoints c USING (checkpoint_id) JOIN family_tensors ft "
            "ON ft.base_id = c.base_id AND ft.tensor_idx = et.tensor_idx WHERE list_contains(?, et.checkpoint_id) "
            "ORDER BY 1, 2",
            [ids],
        ).fetchall()
        for cid, tidx, grid, codes, counts, numel in rows:
            pos = pos_of[cid]
            density = float(values.density[pos, tidx])
            gamma = float(values.gamma[pos, tidx]) if m.sparsify == "band" and values.gamma is not None else 0.0
            lo, lo_exact = _threshold_at(gamma + density, grid, codes, counts, numel)
            hi, hi_exact = (None, True)
            if gamma > 0 and int(gamma * numel) >= 1:
                hi, hi_exact = _threshold_at(gamma, grid, codes, counts, numel)
            for k, v in zip(cols, (cid, tidx, lo, hi, lo_exact and hi_exact)):
                cols[k].append(v)
    return pa.table(
        {
            "checkpoint_id": pa.array(cols["checkpoint_id"], pa.int32()),
            "tensor_idx": pa.array(cols["tensor_idx"], pa.int32()),
            "t_lo": pa.array(cols["t_lo"], pa.float32()),
            "t_hi": pa.array(cols["t_hi"], pa.float32()),
            "exact": pa.array(cols["exact"], pa.bool_()),
        }
    )


def _threshold_at(
    density: float, grid: list[float], codes: list[int], counts: list[int], numel: int
) -> tuple[float, bool]:
    hit = np.flatnonzero(np.abs(stats.DENSITY_GRID - density) < 1e-12)
    if len(hit):
        return float(grid[int(hit[0])]), True
    return stats.threshold_from_summary(np.asarray(codes), np.asarray(counts), numel, density), False
