"""The plan's candidates: every (expert, block) of its experts, scored, as numpy arrays.

queries/plan_candidates.sql (or plan_candidates_trimmed.sql) reads each expert block's norm in one
scan without joins; queries/plan_block_bytes.sql gives each family block's byte cost. `cost` and
`value` below put them together — the one place a candidate's cost is defined. Everything after
is greedy.py's, in memory.

LoRA adapters (schema/009) cost what a merge reads: a block's own rows (expert_blocks.read_bytes)
and, once per (expert, tensor), the factor every block of the tensor needs (expert_tensors.
fixed_bytes, queries/plan_fixed_bytes.sql). `charge_fixed` charges that factor to exactly one
candidate of the (expert, tensor), its carrier (the non-free candidate with the highest score,
lowest block_idx on ties): the carrier's cost includes the fixed bytes and its score becomes
value / (read + fixed) (a random score stays as it is); the tensor's other candidates have their
scores capped strictly below the carrier's (× (1 − 2⁻⁴⁰)), so the carrier precedes them in the
plan's order and any prefix of that order that holds one of them holds the carrier. The greedy's
fill (greedy.py) takes them only once their carrier is taken. So the selected bytes count every
fixed factor once, exactly, and stay within the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from . import bounds, freshmem, greedy
from .errors import CatalogError, PlanError
from .resources import positions, query, statement

_COLUMNS = {
    "position": np.int32,
    "tensor_idx": np.int32,
    "block_idx": np.int32,
    "free": np.bool_,
    "norm": np.float64,
    "read_bytes": np.int64,  # -1: a dense expert's block (its cost is the block's bytes)
}
_CAP = 1 - 2**-40  # a carrier's other candidates score at most this × the carrier's score


@dataclass(frozen=True)
class Scoring:
    """What the candidates SQL needs: the plan's experts, their per-tensor coefficients, the trims."""

    ids: tuple[int, ...]  # checkpoint_id per expert position
    coef: np.ndarray  # (K, T) c_k of each (expert, tensor)
    trims: pa.Table  # (checkpoint_id, tensor_idx, t_lo, t_hi): planstats.thresholds
    trimmed: bool  # value of the survivors of the trim (queries/plan_candidates_trimmed.sql)
    random_seed: int | None = None  # --strategy random: uniform scores from the seed
    drop_nonfinite: bool = False  # --allow-nonfinite: leave blocks with NaN/Inf deltas out
    sqrt_size: bool = False  # ranked score value / √cost instead of value / cost (accessrules: norm-sqrt)


def per_cost(value: np.ndarray, cost: np.ndarray, sqrt_size: bool) -> np.ndarray:
    """A ranked score: value / max(cost, 1), or value / √max(cost, 1) (planpass.score_rows' operations)."""
    c = np.maximum(cost, 1).astype(np.float64)
    return value / (np.sqrt(c) if sqrt_size else c)


def cost(fam: bounds.FamilyBlocks, gblock: np.ndarray, read_bytes: np.ndarray) -> np.ndarray:
    """(N,) int64 bytes the budget is charged for each candidate before fixed costs: what a merge
    reads for it, its block's bytes in the file for a dense expert (read_bytes −1), an adapter's
    read_bytes otherwise (0: a block the adapter leaves untouched). Overwrites `read_bytes`."""
    dense = read_bytes < 0
    if dense.all():  # no adapter: in place, no (N,) temporaries (35M rows are 280 MB each)
        np.take(fam.nbytes, gblock, out=read_bytes)
    elif dense.any():
        np.copyto(read_bytes, fam.nbytes[gblock], where=dense)
    return read_bytes


def charge_fixed(
    pair: np.ndarray,
    fixed: np.ndarray,
    block_idx: np.ndarray,
    free: np.ndarray,
    sqrt_size: bool = False,
    **arrays: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Charge each (expert, tensor)'s fixed bytes to its carrier (see the module note), in place on
    arrays["nbytes"] and arrays["score"]; arrays["value"] set: ranked scores, the carrier's becomes
    value / cost (per_cost); absent: random scores, kept. `pair` (N,) int64 position·T + tensor_idx, `fixed`
    (K·T,) int64 fixed bytes of each pair (0: none). Returns (dependent, carrier): the rows of the
    other non-free candidates of those pairs and, for each, its carrier's row (empty: dense plans)."""
    nbytes, score, value = arrays["nbytes"], arrays["score"], arrays.get("value")
    rows = np.flatnonzero(~free & (fixed[pair] > 0))  # (M,) candidates of tensors with a fixed cost
    # per pair: best score first, lowest block_idx on ties (unique within a pair)
    rows = rows[np.lexsort((block_idx[rows], -score[rows], pair[rows]))]
    first = np.ones(rows.size, bool)
    first[1:] = pair[rows[1:]] != pair[rows[:-1]]
    carriers = rows[first]
    group = np.cumsum(first) - 1  # (M,) index of each row's carrier in `carriers`
    nbytes[carriers] += fixed[pair[carriers]]
    if value is not None:
        score[carriers] = per_cost(value[carriers], nbytes[carriers], sqrt_size)
    dependent = rows[~first]
    carrier = carriers[group[~first]]
    cap_dependents(score, dependent, carrier)
    return dependent, carrier


def cap_dependents(score: np.ndarray, dependent: np.ndarray, carrier: np.ndarray) -> None:
    """Each dependent's score strictly below its carrier's, in place. nextafter guards scores so
    small that the product rounds back up; a carrier scoring 0 has only 0-score others, which the
    order puts after it (lower block_idx)."""
    cap = np.minimum(score[carrier] * _CAP, np.nextafter(score[carrier], 0))
    score[dependent] = np.minimum(score[dependent], cap)


def fetch(
    con: duckdb.DuckDBPyConnection, sc: Scoring, fam: bounds.FamilyBlocks, steps: list[tuple[str, str, int]]
) -> greedy.Candidates:
    """Read the candidates once, in batches, into numpy arrays, and score them: value = |c_k|·norm,
    score = value / cost (or the random ablation's score)."""
    name = "plan_candidates_trimmed" if sc.trimmed else "plan_candidates"
    ids = [int(i) for i in sc.ids]
    n_tensors = fam.first_block.size - 1
    trim_lo, trim_hi = pair_trims(sc.trims, ids, n_tensors) if sc.trimmed else (None, None)
    total = len(ids) * int(fam.first_block[-1])  # at most every block of every expert; untouched
    # pages of np.empty cost no memory, and the arrays are cut to the rows read
    cols: dict[str, np.ndarray] = {c: freshmem.empty(total, t) for c, t in _COLUMNS.items()}
    random = freshmem.empty(total if sc.random_seed is not None else 0, np.float64)
    large = total >= greedy.COMPILED_MIN_ROWS  # the compiled pass below fills two more arrays
    gblock = freshmem.empty(total if large else 0, np.int64)
    score = random if random.size or not large else freshmem.empty(total, np.float64)
    # batches of 64k rows: their buffers are reused; 1M-row batches came back as fresh pages each time
    reader = con.sql(
        positions(3) + statement(name), params=[sc.drop_nonfinite, sc.random_seed, ids, list(range(len(ids)))]
    ).to_arrow_reader(1 << 16)
    at = 0
    ahead = [*cols.values(), random, gblock, score] if large else []
    with freshmem.Prefault(ahead, total) as prefault:  # maps the next rows' pages on another thread
        for batch in reader:  # one batch at a time: memory is the arrays plus one batch
            end = at + batch.num_rows
            if end > total:
                raise PlanError(f"internal error: more candidates than {total} expert blocks; nothing was stored")
            for i, c in enumerate(cols):
                cols[c][at:end] = batch.column(i).to_numpy(zero_copy_only=False)
            if sc.trimmed:  # the trimmed query's histograms follow random_score
                pair = cols["position"][at:end].astype(np.int64) * n_tensors + cols["tensor_idx"][at:end]
                trimmed_norms(batch, len(cols) + 1, trim_lo[pair], trim_hi[pair], out=cols["norm"][at:end])
            if random.size:
                random[at:end] = batch.column(len(cols)).to_numpy(zero_copy_only=False)
            at = end
            prefault.reached(at)
    # only adapters have fixed bytes, and only their blocks have read_bytes ≥ 0: dense plans skip the statement
    adapters = cols["read_bytes"][:at].max(initial=-1) >= 0
    fixed = _fixed_bytes(con, ids, n_tensors) if adapters else np.zeros(len(ids) * n_tensors, np.int64)
    cols = {c: v[:at] for c, v in cols.items()}
    random = random[:at]
    steps.append(("candidates", query(name), at))
    if at >= greedy.COMPILED_MIN_ROWS:  # one compiled pass, in place: no (N,) temporaries
        from . import planpass

        gblock, score = gblock[:at], score[:at]
        nbytes, value = cols.pop("read_bytes"), cols.pop("norm")
        coef = np.ascontiguousarray(sc.coef, np.float64)
        args = (cols["position"], cols["tensor_idx"], cols["block_idx"], nbytes, value, fam.first_block, fam.nbytes)
        planpass.score_rows(*args, coef, not random.size, sc.sqrt_size, gblock, score)
    else:
        gblock = fam.first_block[cols["tensor_idx"]]  # (N,) int64: the index type bincount needs
        gblock += cols["block_idx"]
        nbytes = cost(fam, gblock, cols.pop("read_bytes"))
        value = np.abs(sc.coef[cols["position"], cols["tensor_idx"]])
        value *= cols.pop("norm")
        score = random if random.size else per_cost(value, nbytes, sc.sqrt_size)
    dependent = carrier = np.zeros(0, np.int64)
    if fixed.any():  # some adapter of the plan has fixed costs
        pair = cols["position"].astype(np.int64) * n_tensors + cols["tensor_idx"]  # (N,) int64
        ranked = {} if random.size else {"value": value}
        dependent, carrier = charge_fixed(
            pair, fixed, cols["block_idx"], cols["free"], sc.sqrt_size, nbytes=nbytes, score=score, **ranked
        )
        steps.append(("fixed_cost", "-- candidates.charge_fixed: a carrier per (expert, tensor)", int(dependent.size)))
    return greedy.Candidates.build(
        cols,
        nbytes=nbytes,
        value=value,
        score=score,
        gblock=gblock,
        n_family_blocks=int(fam.first_block[-1]),
        dependent=dependent,
        carrier=carrier,
    )


def pair_trims(trims: pa.Table, ids: list[int], n_tensors: int) -> tuple[np.ndarray, np.ndarray]:
    """(K·T,) float32 lower and upper trims of each (position, tensor) pair, position·T + tensor_idx,
    from planstats.thresholds' rows: −inf where a pair has no lower trim (or no row), +inf where it
    has no upper trim (NULL t_lo, t_hi). The candidates' trims are looked up here: a LEFT JOIN to the
    table registered in DuckDB cost ~2 ms a plan."""
    lo = np.full(len(ids) * n_tensors, -np.inf, np.float32)
    hi = np.full(len(ids) * n_tensors, np.inf, np.float32)
    if trims.num_rows:
        position = {c: p for p, c in enumerate(ids)}
        pos = np.array([position[int(c)] for c in trims.column("checkpoint_id").to_pylist()], np.int64)
        pair = pos * n_tensors + trims.column("tensor_idx").to_numpy()
        for out, name in ((lo, "t_lo"), (hi, "t_hi")):
            v = trims.column(name).to_numpy(zero_copy_only=False).astype(np.float32)  # NULL -> NaN
            known = ~np.isnan(v)
            out[pair[known]] = v[known]
    return lo, hi


def trimmed_norms(batch: pa.RecordBatch, first: int, t_lo: np.ndarray, t_hi: np.ndarray, out: np.ndarray) -> None:
    """‖Δ_kb surviving the trim‖ of each row of a plan_candidates_trimmed batch into `out`: from the
    block's histogram (columns first.. first+2: hist_lo, hist_hi, hist_sumsq) and the row's trim
    `t_lo`, `t_hi` ((n,) float32, ±inf: none; pair_trims), Σ_bins sumsq · overlap([lo, hi), [t_lo,
    t_hi)) / (hi − lo), the edge arithmetic in float32 as the stored edges and trims are; a free
    block's norm is 0."""
    counts, (lo, hi, sumsq) = histogram_bins([batch.column(c) for c in (first, first + 1, first + 2)])
    n = batch.num_rows
    row = np.repeat(np.arange(n), counts)
    kept = np.minimum(hi, np.repeat(t_hi, counts))  # float32
    kept -= np.maximum(lo, np.repeat(t_lo, counts))
    part = np.maximum(kept, 0).astype(np.float64)
    part *= sumsq  # the old SQL's order of operations: sumsq · kept / (hi − lo)
    part /= hi - lo
    out[:] = np.sqrt(np.bincount(row, weights=part, minlength=n))
    out[batch.column(3).to_numpy(zero_copy_only=False)] = 0.0  # free: identical to the base


def histogram_bins(lists: list[pa.ListArray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Per row, its block's histogram bins from list columns of expert_blocks (hist_lo, hist_hi, …):
    (n,) bins of each row, and each column's values of all rows' bins, row after row. Refuses a
    damaged catalog whose lists of one block differ in length."""
    offsets = lists[0].offsets.to_numpy()  # (n+1,): these rows into the (unsliced) value buffers
    if any(not np.array_equal(c.offsets.to_numpy(), offsets) for c in lists[1:]):
        raise CatalogError(
            "expert_blocks has a block whose histogram columns differ in length; the catalog is damaged: "
            "register the experts again into a new catalog"
        )
    a, b = int(offsets[0]), int(offsets[-1])
    return np.diff(offsets), [c.values.to_numpy()[a:b] for c in lists]


def _fixed_bytes(con: duckdb.DuckDBPyConnection, ids: list[int], n_tensors: int) -> np.ndarray:
    """(K·T,) int64 fixed bytes of each (position, tensor) pair (queries/plan_fixed_bytes.sql)."""
    t = con.sql(positions(1) + statement("plan_fixed_bytes"), params=[ids, list(range(len(ids)))]).to_arrow_table()
    fixed = np.zeros(len(ids) * n_tensors, np.int64)
    pos = t.column("position").to_numpy().astype(np.int64)
    fixed[pos * n_tensors + t.column("tensor_idx").to_numpy()] = t.column("fixed_bytes").to_numpy()
    return fixed


def family_blocks(con: duckdb.DuckDBPyConnection, base_id: int, dtypes: list[str]) -> bounds.FamilyBlocks:
    """The base family's blocks in (tensor_idx, block_idx) order (queries/plan_block_bytes.sql);
    `dtypes`: each tensor's dtype name, by tensor_idx (family_tensors.dtype)."""
    t = con.sql(statement("plan_block_bytes"), params=[base_id]).to_arrow_table()
    tix, bix = t.column("tensor_idx").to_numpy(), t.column("block_idx").to_numpy()
    order = np.lexsort((bix, tix))  # the query's rows come in no order; (tensor_idx, block_idx) is unique
    tix = tix[order]
    counts = np.bincount(tix, minlength=len(dtypes))
    first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    if not np.array_equal(bix[order], np.arange(tix.size) - first[tix]):
        raise PlanError(f"internal error: base {base_id}'s blocks are not numbered 0, 1, … per tensor")

    def col(name: str) -> np.ndarray:  # NULL becomes NaN (float64) where a column has NULLs
        return t.column(name).to_numpy(zero_copy_only=False)[order]

    return bounds.FamilyBlocks(
        first_block=first,
        tensor_idx=tix,
        nbytes=col("nbytes").astype(np.int64),
        dtype=np.asarray(dtypes, dtype=object)[tix],
        base_norm=col("base_norm").astype(np.float64),  # NaN: NULL (before 005)
        numel=col("numel").astype(np.float64),
        base_nonfinite=col("base_nonfinite").astype(np.float64),  # NaN: NULL
    )
