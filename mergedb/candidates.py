"""The plan's candidates: every (expert, block) of its experts, scored, as numpy arrays.

queries/plan_candidates.sql (or plan_candidates_trimmed.sql) reads each expert block's norm in one
scan without joins; queries/plan_block_bytes.sql gives each family block's byte cost. `cost` and
`value` below put them together — the one place a candidate's cost is defined. Everything after
is greedy.py's, in memory.
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

_COLUMNS = {"position": np.int32, "tensor_idx": np.int32, "block_idx": np.int32, "free": np.bool_, "norm": np.float64}


@dataclass(frozen=True)
class Scoring:
    """What the candidates SQL needs: the plan's experts, their per-tensor coefficients, the trims."""

    ids: tuple[int, ...]  # checkpoint_id per expert position
    coef: np.ndarray  # (K, T) c_k of each (expert, tensor)
    trims: pa.Table  # (checkpoint_id, tensor_idx, t_lo, t_hi): planstats.thresholds
    trimmed: bool  # value of the survivors of the trim (queries/plan_candidates_trimmed.sql)
    random_seed: int | None = None  # --strategy random: uniform scores from the seed
    drop_nonfinite: bool = False  # --allow-nonfinite: leave blocks with NaN/Inf deltas out


def cost(fam: bounds.FamilyBlocks, gblock: np.ndarray) -> np.ndarray:
    """(N,) int64 bytes the budget is charged for each candidate: its block's bytes in the file."""
    return fam.nbytes[gblock]


def fetch(
    con: duckdb.DuckDBPyConnection, sc: Scoring, fam: bounds.FamilyBlocks, steps: list[tuple[str, str, int]]
) -> greedy.Candidates:
    """Read the candidates once, in batches, into numpy arrays, and score them: value = |c_k|·norm,
    score = value / cost (or the random ablation's score)."""
    name = "plan_candidates_trimmed" if sc.trimmed else "plan_candidates"
    con.register("_plan_trim", sc.trims)
    con.register(
        "_plan_positions",
        pa.table(
            {"checkpoint_id": pa.array(sc.ids, pa.int32()), "position": pa.array(np.arange(len(sc.ids)), pa.int32())}
        ),
    )
    try:
        ids = [int(i) for i in sc.ids]
        total = len(ids) * int(fam.first_block[-1])  # at most every block of every expert; untouched
        # pages of np.empty cost no memory, and the arrays are cut to the rows read
        cols = {c: np.empty(total, t) for c, t in _COLUMNS.items()}
        random = np.empty(total if sc.random_seed is not None else 0, np.float64)
        reader = con.sql(query(name), params=[sc.drop_nonfinite, sc.random_seed]).to_arrow_reader(1 << 20)
        at = 0
        for batch in reader:  # one batch at a time: memory is the arrays plus one batch
            end = at + batch.num_rows
            if end > total:
                raise PlanError(f"internal error: more candidates than {total} expert blocks; nothing was stored")
            for i, c in enumerate(cols):
                cols[c][at:end] = batch.column(i).to_numpy(zero_copy_only=False)
            if random.size:
                random[at:end] = batch.column(len(cols)).to_numpy(zero_copy_only=False)
            at = end
    finally:
        unregister(con, "_plan_trim")
        unregister(con, "_plan_positions")
    cols = {c: v[:at] for c, v in cols.items()}
    random = random[:at]
    steps.append(("candidates", query(name), at))
    gblock = fam.first_block[cols["tensor_idx"]]  # (N,) int64: the index type bincount needs
    gblock += cols["block_idx"]
    nbytes = cost(fam, gblock)
    value = np.abs(sc.coef[cols["position"], cols["tensor_idx"]])
    value *= cols.pop("norm")
    score = random if random.size else value / np.maximum(nbytes, 1)
    return greedy.Candidates.build(
        cols, nbytes=nbytes, value=value, score=score, gblock=gblock, n_family_blocks=int(fam.first_block[-1])
    )


def family_blocks(con: duckdb.DuckDBPyConnection, base_id: int, n_tensors: int) -> bounds.FamilyBlocks:
    """The base family's blocks in (tensor_idx, block_idx) order (queries/plan_block_bytes.sql)."""
    t = con.sql(query("plan_block_bytes"), params=[base_id]).to_arrow_table()
    tix = t.column("tensor_idx").to_numpy()
    counts = np.bincount(tix, minlength=n_tensors)
    first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    if not np.array_equal(t.column("block_idx").to_numpy(), np.arange(tix.size) - first[tix]):
        raise PlanError(f"internal error: base {base_id}'s blocks are not numbered 0, 1, … per tensor")
    return bounds.FamilyBlocks(
        first_block=first,
        tensor_idx=tix,
        nbytes=t.column("nbytes").to_numpy().astype(np.int64),
        dtype=np.asarray(t.column("dtype").to_pylist(), dtype=object),
        base_norm=t.column("base_norm").to_numpy(zero_copy_only=False).astype(np.float64),  # NaN: NULL (before 005)
        numel=t.column("numel").to_numpy().astype(np.float64),
        base_nonfinite=t.column("base_nonfinite").to_numpy(zero_copy_only=False).astype(np.float64),  # NaN: NULL
    )
