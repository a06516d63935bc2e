"""What the planner reads from the catalog per (expert, tensor): trim thresholds at each pair's
density, NaN/Inf counts, and SLERP's coefficients from ‖θ₀‖², ‖Δ‖² and ⟨θ₀, Δ⟩ (queries/slerp_stats.sql).

Runs inside the planner's transaction, on the connection it hands over.
"""

from __future__ import annotations

from dataclasses import replace

import duckdb
import numpy as np
import pyarrow as pa

from . import bounds, methods, summary
from .arrowcols import column
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


def thresholds(
    con: duckdb.DuckDBPyConnection, m: methods.Method, values: TensorValues, ids: list[int], numel: np.ndarray
) -> pa.Table:
    """Per (expert, tensor) trim thresholds at that pair's density (and γ): exact from the density
    grid when the density is on it, from the magnitude summary otherwise (the lower edge of the k-th
    largest's bin: at least k kept; summary.threshold_from_summary). The rows
    come as Arrow columns (no Python object per grid entry); only pairs off the grid read their
    summary. `numel`: (T,) elements of each family tensor. Rows in (checkpoint_id, tensor_idx) order."""
    if m.sparsify not in ("magnitude", "band"):
        return _trims(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0), np.zeros(0), np.zeros(0, bool))
    # no join, no ORDER BY (each costs a small plan ~0.3–1 ms): numel comes from the caller and
    # the rows are ordered here, by (checkpoint_id, tensor_idx), unique per row
    # only the grid entries some pair needs (list_select; a plan has one or a few densities):
    # fetching all 190 per pair cost TIES's first plan ~1.2 ms more
    wanted = _grid_indices(m, values)
    slot = np.full(len(summary.DENSITY_GRID), -1, np.int64)  # grid index -> place in the fetched list
    slot[wanted] = np.arange(len(wanted))
    t = con.sql(
        "SELECT checkpoint_id, tensor_idx, list_select(grid_threshold, $2) AS grid FROM expert_tensors "
        "WHERE list_contains($1, checkpoint_id)",
        params=[ids, [j + 1 for j in wanted]],
    ).to_arrow_table()
    cid, tidx = t.column("checkpoint_id").to_numpy(), t.column("tensor_idx").to_numpy()
    order = np.lexsort((tidx, cid))
    cid, tidx = cid[order], tidx[order]
    grid = t.column("grid").combine_chunks()  # FLOAT[] per pair: the selected grid entries
    grid_at = grid.offsets.to_numpy()[:-1][order]  # (n,) where each pair's entries start in grid.values
    grid_values = grid.values.to_numpy()
    numel = numel[tidx]
    pos_of = np.full(max(ids, default=0) + 1, -1, np.int64)
    pos_of[ids] = np.arange(len(ids))
    pos = pos_of[cid]
    density = values.density[pos, tidx].astype(np.float64)
    gamma = np.zeros_like(density)
    if m.sparsify == "band" and values.gamma is not None:
        gamma = values.gamma[pos, tidx].astype(np.float64)
    summaries: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def at(d: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Thresholds at densities `d` of pairs `rows`: the grid's entry where d is on the grid (the
        same 1e-12 match as _grid_indices), else from the pair's summary (read once, when needed)."""
        on = _on_grid(d)
        out = np.zeros(d.size, np.float64)
        hit = on >= 0
        out[hit] = grid_values[grid_at[rows[hit]] + slot[on[hit]]]
        for i in np.flatnonzero(~hit).tolist():
            if not summaries:
                summaries.update(_summaries(con, ids))
            r = int(rows[i])
            codes, counts = summaries[(int(cid[r]), int(tidx[r]))]
            out[i] = summary.threshold_from_summary(codes, counts, int(numel[r]), float(d[i]))
        return out, hit

    every = np.arange(cid.size)
    lo, exact = at(gamma + density, every)
    # γ's own threshold where γ·numel keeps a value (Python's float · int, truncated, as before)
    banded = np.flatnonzero((gamma > 0) & (np.floor(gamma * numel.astype(np.float64)) >= 1))
    hi = np.full(cid.size, np.nan)
    hi[banded], hi_exact = at(gamma[banded], banded)
    exact[banded] &= hi_exact
    has_hi = np.zeros(cid.size, bool)
    has_hi[banded] = True
    return _trims(cid, tidx, lo, hi, exact, has_hi)


def _trims(
    cid: np.ndarray,
    tidx: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    exact: np.ndarray,
    has_hi: np.ndarray | None = None,
) -> pa.Table:
    """The trims table: t_hi is NULL where a pair has no upper threshold (`has_hi` false). Built
    with arrowcols (pa.array of an ndarray imports numpy.ma, ~9 ms of a process's first plan)."""
    return pa.table(
        {
            "checkpoint_id": column(cid.astype(np.int32)),
            "tensor_idx": column(tidx.astype(np.int32)),
            "t_lo": column(lo.astype(np.float32)),
            "t_hi": column(hi.astype(np.float32), has_hi),
            "exact": column(exact.astype(bool)),
        }
    )


def _on_grid(d: np.ndarray) -> np.ndarray:
    """Index into summary.DENSITY_GRID of each density in `d` (-1: off the grid); matched with
    |grid − d| < 1e-12 (the one match thresholds and _grid_indices use), once per distinct value."""
    if not d.size:
        return np.zeros(0, np.int64)
    srt = np.sort(d)
    distinct = srt[np.concatenate([[True], srt[1:] != srt[:-1]])]  # not np.unique: its first call imports
    # numpy.ma, ~9 ms of the first plan of a process
    index = np.array(
        [
            int(h[0]) if len(h) else -1
            for x in distinct
            for h in [np.flatnonzero(np.abs(summary.DENSITY_GRID - x) < 1e-12)]
        ],
        np.int64,
    )
    return index[np.searchsorted(distinct, d)]


def _grid_indices(m: methods.Method, values: TensorValues) -> list[int]:
    """Sorted indices into summary.DENSITY_GRID of every density `thresholds` may look up on the grid:
    γ + density of each (expert, tensor), and γ itself where γ > 0 (a superset: pairs outside the
    plan's rows, and γ·numel < 1, are harmless). The same float64 sums and the same match (_on_grid)."""
    density = np.asarray(values.density, np.float64)
    gamma = np.zeros_like(density)
    if m.sparsify == "band" and values.gamma is not None:
        gamma = np.asarray(values.gamma, np.float64)
    on = _on_grid(np.concatenate([(gamma + density).ravel(), gamma[gamma > 0].ravel()]))
    return sorted(set(on[on >= 0].tolist()))


def nonfinite(
    con: duckdb.DuckDBPyConnection, ids: list[int], names: dict[int, str], tensor_names: list[str]
) -> list[tuple[str, str, int]]:
    """(expert, tensor, count) of every (expert, tensor) of the plan with NaN/Inf deltas, ordered by
    expert then tensor name (UTF-8 bytes, as DuckDB orders VARCHARs); usually none."""
    counts: dict[tuple[int, int], int] = {}
    for cid, tidx, n in con.execute(
        "SELECT checkpoint_id, tensor_idx, nonfinite FROM expert_blocks "
        "WHERE nonfinite > 0 AND list_contains(?, checkpoint_id)",
        [ids],
    ).fetchall():
        counts[(cid, tidx)] = counts.get((cid, tidx), 0) + n
    bad = [(names[cid], tensor_names[tidx], n) for (cid, tidx), n in counts.items()]
    return sorted(bad, key=lambda r: (r[0].encode(), r[1].encode()))


def refuse_nonfinite_base(
    con: duckdb.DuckDBPyConnection,
    base: str,
    base_id: int,
    ids: list[int],
    fam: bounds.FamilyBlocks,
    tensor_names: list[str],
) -> None:
    """Blame NaN/Inf in the base on the base (every expert's delta inherits them), with or without
    --allow-nonfinite: leaving those blocks out would still copy the base's NaN/Inf into the merge."""
    counts = np.bincount(fam.tensor_idx, weights=np.nan_to_num(fam.base_nonfinite), minlength=len(tensor_names))
    bad = np.flatnonzero(counts > 0)
    fix = "fix the base and register it again under a new --name (its experts with it)"
    if bad.size:
        t, n = tensor_names[bad[0]], int(counts[bad[0]])
        more = f" (and {bad.size - 1} more tensors)" if bad.size > 1 else ""
        raise PlanError(f"base {base!r} has {n} NaN/Inf values in tensor {t!r}{more}; {fix}")
    known = int(np.count_nonzero(~np.isnan(fam.base_nonfinite)))
    if known or len(ids) < 2:
        return
    # a catalog registered before base checks: NaN/Inf in one block of every expert points at the base
    shared = con.execute(
        "SELECT ft.name FROM expert_blocks eb JOIN family_tensors ft ON ft.base_id = ? "
        "AND ft.tensor_idx = eb.tensor_idx WHERE eb.nonfinite > 0 AND list_contains(?, eb.checkpoint_id) "
        "GROUP BY ft.name, eb.tensor_idx, eb.block_idx HAVING count(*) = ? "
        "ORDER BY eb.tensor_idx, eb.block_idx LIMIT 1",
        [base_id, ids, len(ids)],
    ).fetchall()
    if shared:
        raise PlanError(
            f"every expert has NaN/Inf values in the same block of tensor {shared[0][0]!r}: most likely base "
            f"{base!r} holds them (it was registered before mergedb checked bases); {fix}"
        )


def _summaries(con: duckdb.DuckDBPyConnection, ids: list[int]) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """(checkpoint_id, tensor_idx) -> the magnitude summary's codes and counts, for thresholds off the grid."""
    rows = con.execute(
        "SELECT checkpoint_id, tensor_idx, summary_code, summary_count FROM expert_tensors "
        "WHERE list_contains(?, checkpoint_id)",
        [ids],
    ).fetchall()
    return {(c, t): (np.asarray(codes), np.asarray(counts)) for c, t, codes, counts in rows}
