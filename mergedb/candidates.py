"""The plan's candidates: every (expert, block) scored in SQL, read once into numpy arrays.

queries/plan_candidates.sql (or plan_candidates_trimmed.sql) computes each candidate's byte cost
(`nbytes`, the one place the cost is defined) and value; queries/plan_random_scores.sql replaces
the scores for the random ablation. Everything after the fetch is greedy.py's, in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from . import bounds, greedy
from .errors import PlanError
from .faults import unregister
from .resources import query

_CANDIDATE_COLUMNS = {
    "position": np.int32,
    "tensor_idx": np.int32,
    "block_idx": np.int32,
    "nbytes": np.int64,
    "free": np.bool_,
    "value": np.float64,
    "score": np.float64,
}


@dataclass(frozen=True)
class Scoring:
    """What the candidates SQL needs: the plan's experts, their per-tensor coefficients, the trims."""

    base_id: int
    ids: tuple[int, ...]  # checkpoint_id per expert position
    coef: np.ndarray  # (K, T) c_k of each (expert, tensor)
    trims: pa.Table  # (checkpoint_id, tensor_idx, t_lo, t_hi): planstats.thresholds
    trimmed: bool  # value of the survivors of the trim (queries/plan_candidates_trimmed.sql)
    random_seed: int | None = None  # --strategy random: scores from queries/plan_random_scores.sql
    drop_nonfinite: bool = False  # --allow-nonfinite: leave blocks with NaN/Inf deltas out


def fetch(
    con: duckdb.DuckDBPyConnection, sc: Scoring, first_block: np.ndarray, steps: list[tuple[str, str, int]]
) -> greedy.Candidates:
    """Fill the temp table plan_candidates (queries/plan_candidates*.sql, then the random scores
    and the non-finite exclusions) and read it once, in batches, into numpy arrays."""
    k, n = sc.coef.shape
    con.register(
        "_plan_experts",  # one row per (expert, tensor): its coefficient there
        pa.table(
            {
                "checkpoint_id": pa.array(np.repeat(sc.ids, n), pa.int32()),
                "position": pa.array(np.repeat(np.arange(k), n), pa.int32()),
                "tensor_idx": pa.array(np.tile(np.arange(n), k), pa.int32()),
                "coef": pa.array(sc.coef.reshape(-1), pa.float64()),
            }
        ),
    )
    con.register("_plan_trim", sc.trims)
    try:
        name = "plan_candidates_trimmed" if sc.trimmed else "plan_candidates"
        # the joins in written order: expert_blocks probes the small tables (the optimizer would
        # cross the per-(expert, tensor) rows with the blocks first: K·T·blocks rows)
        con.execute("SET disabled_optimizers = 'join_order'")
        try:
            con.execute(query(name), [sc.base_id]).fetchall()
        finally:
            con.execute("RESET disabled_optimizers")
        if sc.random_seed is not None:
            con.execute(query("plan_random_scores"), [sc.random_seed]).fetchall()
            steps.append(("random", query("plan_random_scores"), 0))
        if sc.drop_nonfinite:
            con.execute(
                "DELETE FROM plan_candidates WHERE (checkpoint_id, tensor_idx, block_idx) IN "
                "(SELECT (checkpoint_id, tensor_idx, block_idx) FROM expert_blocks WHERE nonfinite > 0)"
            )
    finally:
        unregister(con, "_plan_experts")
        unregister(con, "_plan_trim")
    total = int(con.execute("SELECT count(*) FROM plan_candidates").fetchall()[0][0])
    steps.append(("candidates", query(name), total))
    cols = {c: np.empty(total, t) for c, t in _CANDIDATE_COLUMNS.items()}
    reader = con.sql(f"SELECT {', '.join(cols)} FROM plan_candidates").to_arrow_reader(1 << 20)
    at = 0
    for batch in reader:  # one batch at a time: memory is the arrays plus one batch
        for i, c in enumerate(cols):
            cols[c][at : at + batch.num_rows] = batch.column(i).to_numpy(zero_copy_only=False)
        at += batch.num_rows
    con.execute("DROP TABLE plan_candidates")
    return greedy.Candidates.build(cols, first_block)


def family_blocks(con: duckdb.DuckDBPyConnection, base_id: int, n_tensors: int) -> bounds.FamilyBlocks:
    """The base family's blocks in (tensor_idx, block_idx) order, for the bounds and the block index."""
    t = con.sql(
        "SELECT ft.tensor_idx, bl.block_idx, ft.dtype, bl.base_norm, bl.numel FROM family_tensors ft "
        "JOIN blocks bl USING (base_id, tensor_idx) WHERE ft.base_id = $1 ORDER BY ft.tensor_idx, bl.block_idx",
        params=[base_id],
    ).to_arrow_table()
    tix = t.column("tensor_idx").to_numpy()
    counts = np.bincount(tix, minlength=n_tensors)
    first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    if not np.array_equal(t.column("block_idx").to_numpy(), np.arange(tix.size) - first[tix]):
        raise PlanError(f"internal error: base {base_id}'s blocks are not numbered 0, 1, … per tensor")
    norm = t.column("base_norm")
    return bounds.FamilyBlocks(
        first_block=first,
        dtype=np.asarray(t.column("dtype").to_pylist(), dtype=object),
        base_norm=norm.to_numpy(zero_copy_only=False).astype(np.float64),  # NaN where NULL (registered before 005)
        numel=t.column("numel").to_numpy().astype(np.float64),
        tensor_idx=tix,
    )
